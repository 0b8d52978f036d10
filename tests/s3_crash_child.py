"""A process that syncs one workspace to S3 and SIGKILLs itself at a chosen point.

Run by ``tests/test_storage_crash.py`` as
``python -m tests.s3_crash_child '<json>'`` with the endpoint and credentials
in the environment (``CORRAL_S3_ENDPOINT_URL``, ``AWS_*``). The JSON names
the location (``bucket``, ``prefix``), the ``state_dir``, the owner
(``owner``, ``uid``, ``gid``, ``directory``), the ``conversation``, the
number of ``blobs`` the sync is expected to upload, and the ``point``:

``before_first_blob``
    before the first blob PutObject is sent;
``after_first_blob``
    once one blob PutObject has been answered;
``after_half_blobs``
    once half of the expected blobs (rounded up) have been answered;
``before_manifest``
    every blob is up, the manifest PutObject is about to be sent;
``after_manifest``
    the manifest PutObject has been answered (the store has the new
    version), before the local state is saved;
``after_state_saved``
    ``sync_blocking`` returned: the state is saved; nothing else ran.

The points hook boto3's own events on the backend's client
(``before-call`` / ``after-call`` of ``s3.PutObject``), so the requests are
real and the kill lands between them, as a power cut or the OOM killer would.
The process exits 0 only when the point was never reached (a test failure:
the parent expects death by SIGKILL).
"""

import json
import os
import signal
import sys
import threading


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Killer:
    """boto3 event hooks that kill the process at ``point``."""

    def __init__(self, point: str, blobs: int):
        self.point = point
        self.half = max(1, (blobs + 1) // 2)
        self.answered = 0
        self.lock = threading.Lock()

    @staticmethod
    def _kind(context) -> str:
        key = context.get("corral_key", "")
        if "/blobs/" in key:
            return "blob"
        if key.endswith("/manifest.json"):
            return "manifest"
        return "other"

    def remember_key(self, params, context, **_):
        context["corral_key"] = params.get("Key", "")

    def before(self, context, **_):
        kind = self._kind(context)
        if (kind, self.point) in (("blob", "before_first_blob"), ("manifest", "before_manifest")):
            _die()

    def after(self, context, http_response=None, **_):
        kind = self._kind(context)
        if kind == "manifest" and self.point == "after_manifest":
            _die()
        if kind == "blob" and getattr(http_response, "status_code", 0) == 200:
            with self.lock:
                self.answered += 1
                if (self.point == "after_first_blob" and self.answered == 1) or (
                        self.point == "after_half_blobs" and self.answered == self.half):
                    _die()

    def register(self, events) -> None:
        events.register("provide-client-params.s3.PutObject", self.remember_key)
        events.register("before-call.s3.PutObject", self.before)
        events.register("after-call.s3.PutObject", self.after)


def main() -> None:
    options = json.loads(sys.argv[1])
    from plugins.storage_s3 import S3Location, S3Storage, make_client
    from supervisor.identities import OwnerIdentity

    storage = S3Storage(S3Location(options["bucket"], options["prefix"]),
                        make_client(os.environ["CORRAL_S3_ENDPOINT_URL"]), options["state_dir"])
    Killer(options["point"], options["blobs"]).register(storage.client.meta.events)
    identity = OwnerIdentity(options["owner"], options["uid"], options["gid"],
                             options["directory"])
    storage.sync_blocking(identity, options["conversation"])
    if options["point"] == "after_state_saved":
        _die()
    print(f"point {options['point']!r} was never reached", file=sys.stderr)
    sys.exit(0)


if __name__ == "__main__":
    main()
