"""The embedded default's Celery broker: kombu's filesystem transport, made safe for a second process.

kombu's filesystem channel creates each message file in the queue folder and only then writes its
body, while a consumer in another process may list the folder and read the file in between: it reads
an empty message and the worker dies with ``JSONDecodeError`` (seen under load with web, worker and
beat on two cores). Here a message is written whole in a staging folder beside the queue folder and
renamed into place; a rename within one file system is atomic, so a consumer sees all of it or none.

Select it with ``CELERY_BROKER_TRANSPORT = "webapp.broker:Transport"``; ``staging_folder`` is a
transport option next to kombu's own ``data_folder_in`` / ``data_folder_out``.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        # The same file name kombu uses (its consumers sort and filter by it), written elsewhere first.
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        staging = os.path.join(self.transport_options["staging_folder"], name)
        try:
            with open(staging, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(staging, os.path.join(self.data_folder_out, name))
        except OSError as exc:
            raise ChannelError(f"Cannot add message {name!r} to {self.data_folder_out!r}") from exc


class Transport(filesystem.Transport):
    Channel = Channel
