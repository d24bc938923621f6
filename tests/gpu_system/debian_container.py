"""systemd 252 from Debian 12's own packages, booted in systemd-nspawn on a
machine that has no systemd (the GPU machine: an Ubuntu 24.04 image, no
systemd, no network), with the NVIDIA devices and driver bound in.

One job: what tests/system/container.py's SystemdContainer needs to boot
there, and nothing else. The packages (fetched on the CPU machine by
packaging/fetch-gpu-tier.sh into .gpu/debs) are unpacked with `dpkg-deb -x`
into a directory of the test's own; Debian 12 is not merged-/usr while the
host is, so their lib/, bin/ and sbin/ are folded into usr/. The container's
/usr is then an overlay: the host's /usr below, the unpacked usr/ above it,
a writable upper layer in the test's work directory on top (so `hostd
install` writes its vendor files there, and the host's /usr is never
written). nspawn itself is the unpacked one, run with LD_LIBRARY_PATH on the
unpacked libraries. Bound in besides what SystemdContainer binds: /opt (the
image's torch lives in /opt/torch/.venv), the driver's own mount
/usr/local/nvidia (a separate mount, which the /usr overlay does not show),
the host's /etc/ld.so.cache (which knows the driver's libcuda and
libnvidia-ml; the volatile /etc has none, a real host does), and each
/dev/nvidia* node with `DeviceAllow=` for it.

Seen on the GPU machine: the device cgroup is not enforced in this nested
container ("the local system does not support BPF/cgroup firewalling"), so
a missing `DeviceAllow=` would go unnoticed there; the tier compares the
generator's lines with NVML instead. The same class boots on the CPU machine
(Debian 12, where the packages are the host's own versions), where the
harness is debugged without device time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from container import SystemdContainer, _escape, find_checkout

CHECKOUT = find_checkout(Path(__file__))
#: Where packaging/fetch-gpu-tier.sh puts the Debian packages (ignored by git).
DEBS = CHECKOUT / ".gpu" / "debs"

#: Read-only from the host, where they exist: the image's Python with torch,
#: the driver (libcuda, libnvidia-ml), the host's library cache.
HOST_PATHS = ("/opt", "/usr/local/nvidia", "/etc/ld.so.cache")

#: The NVIDIA device nodes the units may be given (the GPUs themselves are
#: /dev/nvidiaN, found by listing).
NVIDIA_CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


def nvidia_devices() -> list[str]:
    gpus = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
    return [d for d in (*NVIDIA_CONTROL_DEVICES, *gpus) if Path(d).exists()]


def unpack(debs: Path, root: Path) -> Path:
    """Unpack every .deb in DEBS into ROOT, lib/, bin/ and sbin/ folded into usr/."""
    packages = sorted(debs.glob("*.deb"))
    if not packages:
        raise FileNotFoundError(f"no .deb files in {debs}: run packaging/fetch-gpu-tier.sh on a Debian 12 machine")
    root.mkdir(parents=True, exist_ok=True)
    for deb in packages:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    for top in ("lib", "bin", "sbin"):
        if (root / top).is_dir() and not (root / top).is_symlink():
            shutil.copytree(root / top, root / "usr" / top, symlinks=True, dirs_exist_ok=True)
            shutil.rmtree(root / top)
    return root


class DebianSystemdContainer(SystemdContainer):
    """A SystemdContainer whose systemd and nspawn come from DEBIAN_ROOT (unpack())."""

    # The whole /usr is an overlay with a writable upper layer: no part needs its own.
    writable_usr = ()

    def __init__(self, *, debian_root: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.debian_root = debian_root.resolve()
        self.usr_upper = self.workdir / "usr-upper"
        self._nspawn_args.append(
            f"--overlay=/usr:{_escape(self.debian_root / 'usr')}:{_escape(self.usr_upper)}:/usr")
        for path in HOST_PATHS:
            if Path(path).exists():
                self.add_bind(path)
        for device in nvidia_devices():
            self._nspawn_args += [f"--bind={device}", f"--property=DeviceAllow={device} rw"]

    @property
    def nspawn_binary(self) -> str:  # type: ignore[override]
        return str(self.debian_root / "usr/bin/systemd-nspawn")

    def nspawn_env(self) -> Optional[dict[str, str]]:
        libs = self.debian_root / "usr/lib/x86_64-linux-gnu"
        return {**os.environ, "LD_LIBRARY_PATH": f"{libs / 'systemd'}:{libs}"}

    def support_problem(self) -> Optional[str]:
        if os.geteuid() != 0:
            return "booting systemd-nspawn needs root"
        if shutil.which("nsenter") is None:
            return "nsenter is not installed (util-linux)"
        if not Path(self.nspawn_binary).is_file():
            return f"{self.nspawn_binary} is missing: unpack the Debian packages first"
        return None

    def start(self) -> "DebianSystemdContainer":
        self.usr_upper.mkdir(parents=True, exist_ok=True)
        super().start()
        return self
