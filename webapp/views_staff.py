"""Staff-only pages: the Orphans page (provider jobs carrying Trainboard's tag with no active job row,
found by ``jobs.orphans``) and its Stop button.

An anonymous visitor is sent to the login page; a signed-in user who is not staff gets 403.
"""

from __future__ import annotations

from functools import wraps
from typing import Callable

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from jobs import orphans
from jobs.models import OrphanJob


def staff_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Login required (redirect), then staff required (403 PermissionDenied)."""

    @login_required
    @wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not request.user.is_staff:
            raise PermissionDenied("This page is for staff only.")
        return view(request, *args, **kwargs)

    return wrapped


@staff_required
@require_GET
def orphan_list(request: HttpRequest) -> HttpResponse:
    """Open orphans first (newest sighting first), then the most recently resolved ones."""
    open_orphans, resolved = orphans.orphan_list()
    return render(request, "webapp/orphans/list.html", {"open_orphans": open_orphans, "resolved": resolved})


@staff_required
@require_POST
def orphan_stop(request: HttpRequest, pk: int) -> HttpResponse:
    """Stop one orphan at the provider (``jobs.orphans.orphan_stop``), then back to the list."""
    orphan = get_object_or_404(OrphanJob.objects.select_related("backend"), pk=pk)
    try:
        orphan = orphans.orphan_stop(orphan, request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        if orphan.resolved_at is not None:
            messages.info(request, f"{orphan.provider_job_name} has already ended at the provider.")
        else:
            messages.success(request, f"Stop sent for {orphan.provider_job_name} on {orphan.backend.name}.")
    return redirect("orphan-list")
