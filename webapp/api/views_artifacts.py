"""The job's artifacts in the API (docs/artifacts.md): ``GET /api/jobs/{id}/artifacts/`` lists them
with size and sha256; ``GET /api/jobs/{id}/artifacts/<name>/download/`` answers 302 to a signed URL
valid a few minutes (S3, GCS, Azure Blob) or streams the file as an attachment. Access is the job's
(:class:`~webapp.api.views.TrainingJobViewSet` mixes these actions in)."""

from __future__ import annotations

from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from cloud_adapters.base import BackendError
from jobs.models import JobArtifact
from jobs.services.artifacts import ArtifactNotFound, training_job_artifact_download, training_job_artifact_list
from webapp.views_artifacts import download_response


class JobArtifactSerializer(serializers.ModelSerializer):
    """One artifact: ``size_bytes`` in bytes (null = not known); ``sha256`` hex ("" = not computed:
    larger than the dashboard reads), ``sha256_source`` "provider" or "computed"; ``download_url``
    the API's download link."""

    download_url = serializers.SerializerMethodField()

    class Meta:
        model = JobArtifact
        fields = ["name", "kind", "size_bytes", "sha256", "sha256_source", "modified_at", "listed_at",
                  "download_url"]
        read_only_fields = fields

    def get_download_url(self, row: JobArtifact) -> str:
        path = reverse("api-job-artifact-download", kwargs={"pk": row.job_id, "name": row.name})
        request = self.context.get("request")
        return request.build_absolute_uri(path) if request is not None else path


class JobArtifactActions:
    """The two artifact actions of the jobs viewset."""

    @extend_schema(
        summary="List a job's artifacts",
        description="The files the job left (model, metrics, checkpoints, logs) with size and sha256. "
                    "``error`` is the backend's message when its files cannot be read now (then "
                    "``results`` is the last listing).",
        responses={200: inline_serializer("JobArtifactList", {
            "results": JobArtifactSerializer(many=True), "error": serializers.CharField()})},
    )
    @action(detail=True, methods=["get"], url_path="artifacts", url_name="artifacts", pagination_class=None,
            filterset_class=None)
    def artifacts(self, request: Request, pk: str | None = None, format: str | None = None) -> Response:
        job = self.get_object()
        listing = training_job_artifact_list(job=job)
        rows = JobArtifactSerializer(listing.artifacts, many=True, context=self.get_serializer_context()).data
        return Response({"results": rows, "error": listing.error})

    @extend_schema(
        summary="Download one artifact",
        parameters=[OpenApiParameter("name", OpenApiTypes.STR, OpenApiParameter.PATH,
                                     description="The artifact's name, e.g. checkpoints/last.pt")],
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY,
                   302: OpenApiResponse(description="To a signed URL valid a few minutes"),
                   404: OpenApiResponse(description="No such artifact"),
                   502: OpenApiResponse(description="The backend's files cannot be read now")},
    )
    @action(detail=True, methods=["get"], url_path=r"artifacts/(?P<name>.+)/download", url_name="artifact-download",
            pagination_class=None, filterset_class=None)
    def artifact_download(self, request: Request, pk: str | None = None, name: str = "",
                          format: str | None = None):
        job = self.get_object()
        try:
            download = training_job_artifact_download(job=job, name=name)
        except ArtifactNotFound:
            raise NotFound("This job has no artifact of that name.") from None
        except BackendError as exc:
            return Response({"detail": f"The backend's files cannot be read now: {exc}"}, status=502)
        return download_response(download)
