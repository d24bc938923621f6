"""Fixtures for system tests that need a real systemd.

``systemd_container`` (module scope) boots one container per test module;
``make_systemd_container`` is a factory for tests that need a fresh container
(or their own binds), torn down at the end of the test.  Both skip when the
machine cannot boot containers (not root, no systemd-nspawn) -- except in CI
(``CI=true``), where every test tier must run, so they fail instead.

See container.py for why systemd is only ever booted inside
``systemd-nspawn --volatile=yes`` and never on the host's root filesystem.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from collections.abc import Callable, Iterator

import pytest

# Importable whatever pytest's --import-mode is.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from container import SystemdContainer, find_checkout, host_support_problem  # noqa: E402

CHECKOUT = find_checkout(Path(__file__))


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_container_support() -> None:
    """Skip (or, in CI, fail) when containers cannot be booted here."""
    problem = host_support_problem()
    if problem is None:
        return
    if in_ci():
        pytest.fail(f"CI=true, so system tests must run, but: {problem}", pytrace=False)
    pytest.skip(problem)


class _Containers:
    """Starts containers on demand and stops (and leak-checks) them all."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._started: list[SystemdContainer] = []

    def __call__(self, **kwargs) -> SystemdContainer:
        kwargs.setdefault("checkout", CHECKOUT)
        kwargs.setdefault("workdir", self._tmp.mktemp("nspawn"))
        container = SystemdContainer(**kwargs)
        self._started.append(container)
        return container.start()

    def stop_all(self) -> None:
        errors = []
        for container in reversed(self._started):
            try:
                container.stop()  # raises ContainerLeak if anything survived
            except Exception as exc:  # stop the others before reporting
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture(scope="module")
def systemd_container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdContainer]:
    """A booted container shared by the tests of one module."""
    require_container_support()
    containers = _Containers(tmp_path_factory)
    try:
        yield containers()
    finally:
        containers.stop_all()


@pytest.fixture
def make_systemd_container(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., SystemdContainer]]:
    """Factory: ``make_systemd_container(binds=[...], boot_timeout=...)``
    boots a container (keyword arguments as for SystemdContainer) that is
    stopped at the end of the test."""
    require_container_support()
    containers = _Containers(tmp_path_factory)
    try:
        yield containers
    finally:
        containers.stop_all()


def pytest_collection_modifyitems(session, config, items) -> None:
    """HOSTD_SYSTEM_ORDER=reversed runs the system modules last-first (the
    tests of one module keep their order), the other tiers untouched: CI runs
    them so (packaging/run-tests.sh), so that no module can lean on what a
    module before it left behind in the host or in its own container."""
    if os.environ.get("HOSTD_SYSTEM_ORDER") != "reversed":
        return
    here = Path(__file__).resolve().parent
    slots = [i for i, item in enumerate(items) if here in Path(str(item.path)).resolve().parents]
    modules: dict[Path, list] = {}
    for i in slots:
        modules.setdefault(Path(str(items[i].path)), []).append(items[i])
    reordered = [item for module in reversed(list(modules)) for item in modules[module]]
    for i, item in zip(slots, reordered):
        items[i] = item
