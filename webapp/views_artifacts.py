"""The job page's artifacts: the list (an htmx fragment the page loads after it renders, so a slow
bucket listing never delays the page) and the download of one file by name (docs/artifacts.md).

Access is the job's: a teammate may download, a stranger gets a 404, someone not logged in is sent
to the login page. A name the job does not list, or one with ``..``, is a 404 before any file is
opened. A download is a redirect to a signed URL valid a few minutes where the backend gives one
(S3, GCS, Azure Blob), else the file streamed as an attachment with its Content-Length.
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from cloud_adapters.base import BackendError
from jobs import selectors
from jobs.services.artifacts import (
    ArtifactDownload,
    ArtifactNotFound,
    training_job_artifact_download,
    training_job_artifact_list,
)


def _job(request: HttpRequest, pk: int):
    return get_object_or_404(selectors.training_job_list_for_user(user=request.user).select_related("backend"), pk=pk)


def download_response(download: ArtifactDownload) -> HttpResponse:
    """The HTTP answer for a download: 302 to the signed URL, or the stream as an attachment
    (``Content-Disposition: attachment; filename=...``, Content-Length when the size is known).
    Never cached: a signed URL expires, a stream is the file as it is now."""
    if download.url:
        response: HttpResponse = HttpResponseRedirect(download.url)
    else:
        response = FileResponse(download.stream, as_attachment=True, filename=download.filename,
                                content_type="application/octet-stream")
        if "Content-Length" not in response and download.size_bytes is not None:
            response["Content-Length"] = str(download.size_bytes)
    response["Cache-Control"] = "private, no-store"
    return response


@never_cache
@login_required
@require_GET
def job_artifacts(request: HttpRequest, pk: int) -> HttpResponse:
    """The artifacts table of the job page (name, kind, size, sha256, download link)."""
    job = _job(request, pk)
    listing = training_job_artifact_list(job=job)
    return render(request, "webapp/jobs/_artifact_list.html", {"job": job, "listing": listing})


@login_required
@require_GET
def job_artifact_download(request: HttpRequest, pk: int, name: str) -> HttpResponse:
    """Download the job's artifact ``name`` (a path such as ``checkpoints/last.pt``)."""
    job = _job(request, pk)
    try:
        download = training_job_artifact_download(job=job, name=name)
    except ArtifactNotFound:
        raise Http404("This job has no artifact of that name.") from None
    except BackendError as exc:
        return HttpResponse(f"The backend's files cannot be read now: {exc}", status=502,
                            content_type="text/plain; charset=utf-8")
    return download_response(download)
