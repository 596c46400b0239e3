"""A sandbox image for a machine with no registry: FROM scratch, with Debian's statically linked
busybox (`scripts/start-dockerd.sh` installs busybox-static) and its applets as /bin commands.
The tests' sandboxes and `benchmarks/sandbox_leak.py` run in it."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import docker
from docker.models.images import Image

BUSYBOX = Path("/bin/busybox")  # static: runs in an image with no libc
DOCKERFILE = 'FROM scratch\nCOPY busybox /bin/busybox\nRUN ["/bin/busybox", "--install", "-s", "/bin"]\n'


class BusyboxMissing(RuntimeError):
    pass


def build_busybox_image(client: docker.DockerClient, tag: str, labels: dict[str, str]) -> Image:
    """Build the image under `tag` with `labels` (by which whoever built it finds it to remove it)."""
    if not BUSYBOX.exists():
        raise BusyboxMissing(f"{BUSYBOX} is missing: run scripts/start-dockerd.sh (installs busybox-static)")
    with tempfile.TemporaryDirectory(prefix="busybox-image-") as context:
        shutil.copy(BUSYBOX, Path(context) / "busybox")
        (Path(context) / "Dockerfile").write_text(DOCKERFILE)
        image, _ = client.images.build(path=context, tag=tag, rm=True, labels=labels)
    return image
