"""hostd's Cockpit page (packaging/cockpit/, docs/cockpit.md) in a real browser:
Debian's chromium driven by Playwright, against cockpit-ws and cockpit-bridge
in a real systemd 252 container with dbus, polkitd, the manager and a model.

One container for the module: `hostd install` (which puts the page where
cockpit-bridge reads packages), model tiny serving, hostd.service, and
cockpit-ws without TLS on a socket unit of its own (127.0.0.1 only; a host
serves it through cockpit.socket and TLS). Two password users log in through
Cockpit's own login page: alice, a member of hostd-admin (polkit allows her),
and mallory, whom polkit denies. Each test says what a user sees in the
page and checks the host underneath (the engine's /health, the drop-in, the
manager's operations). Screenshots of the list, the dialog and the results go
to $HOSTD_TEST_ARTEFACTS (default: test-artefacts/ in the checkout).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import CHECKOUT, in_ci
from container import SystemdContainer, wait_for
from ports import reserved_port
from test_manager import DROPINS, hostctl, model_state, read_file, running_max_num_seqs
from test_model_units import prepare_model, status_code

CHROMIUM = "/usr/bin/chromium"  # Debian 12's (apt: chromium; packaging/setup.sh)
ARTEFACTS = Path(os.environ.get("HOSTD_TEST_ARTEFACTS", CHECKOUT / "test-artefacts")) / "cockpit"
USERS = {"alice": "alice-secret-1", "mallory": "mallory-secret-1"}
TIMEOUT_MS = 240_000  # a reload of the tiny model on a busy 2-core machine

# cockpit-ws on a socket unit, as cockpit.socket runs it, without TLS (a test
# on 127.0.0.1; cockpit-ws says "--no-tls" is for exactly this).
COCKPIT_SOCKET = """\
[Socket]
ListenStream=127.0.0.1:{port}
"""
COCKPIT_SERVICE = """\
[Service]
ExecStart=/usr/lib/cockpit/cockpit-ws --no-tls
"""
# The container's /etc is empty: Cockpit's login goes through PAM service
# "cockpit"; password check and account only (the host's own file stacks
# SELinux, loginuid and keyring modules a volatile container has no use for).
PAM_COCKPIT = """\
auth     required pam_unix.so
account  required pam_unix.so
password required pam_unix.so
session  required pam_unix.so
"""


def require_browser() -> None:
    problem = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problem = "the playwright package is not installed (pip install -e '.[test]')"
    if problem is None and not os.access(CHROMIUM, os.X_OK):
        problem = f"{CHROMIUM} is missing (apt-get install chromium; packaging/setup.sh)"
    if problem is None and shutil.which("cockpit-bridge") is None:
        problem = "cockpit-bridge is missing (apt-get install cockpit-ws cockpit-bridge; packaging/setup.sh)"
    if problem:
        if in_ci():
            pytest.fail(f"CI=true, so the Cockpit test must run, but: {problem}", pytrace=False)
        pytest.skip(problem)


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    require_browser()
    c = systemd_container
    port = reserved_port()
    prepare_model(c, port, timeouts="{start: 120, stop: 60}")
    c.base_url = f"http://127.0.0.1:{port}"
    c.write_file("/etc/pam.d/cockpit", PAM_COCKPIT)
    groups = {"alice": "hostd-admin,systemd-journal", "mallory": "systemd-journal"}
    for user, password in USERS.items():
        c.run(["useradd", "--create-home", "--groups", groups[user], user])
        hashed = c.run(["openssl", "passwd", "-6", "-stdin"], input=password).stdout.strip()
        c.run(["usermod", "--password", hashed, user])
    cockpit_port = reserved_port()
    c.install_unit("cockpit-test.socket", COCKPIT_SOCKET.format(port=cockpit_port), reload=False)
    c.install_unit("cockpit-test.service", COCKPIT_SERVICE)
    c.systemctl("start", "cockpit-test.socket", "model@tiny.service", "hostd.service", timeout=300)
    wait_for(lambda: status_code(c) == 200, timeout=120, what="model serving")
    wait_for(lambda: model_state(c) == "serving", timeout=120, what="the manager sees it serving")
    c.cockpit_url = f"http://127.0.0.1:{cockpit_port}"
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    return c


@pytest.fixture(scope="module")
def browser(host):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-gpu"])
        yield browser
        browser.close()


class Session:
    """One user logged in through Cockpit's login page, on hostd's page."""

    def __init__(self, browser, host: SystemdContainer, user: str) -> None:
        self.host = host
        self.context = browser.new_context(viewport={"width": 1360, "height": 900})
        self.context.set_default_timeout(60_000)
        self.page = self.context.new_page()
        self.console: list[str] = []  # the page's console and uncaught errors, for a failure's message
        self.page.on("console", lambda message: self.console.append(f"{message.type}: {message.text}"))
        self.page.on("pageerror", lambda error: self.console.append(f"error: {error}"))
        self.page.goto(host.cockpit_url + "/")
        self.page.fill("#login-user-input", user)
        self.page.fill("#login-password-input", USERS[user])
        self.page.click("#login-button")
        self.page.wait_for_selector("#nav-system, iframe", state="attached")
        self.open("")

    def open(self, fragment: str) -> None:
        self.page.goto(self.host.cockpit_url + "/hostd" + (f"#/{fragment}" if fragment else ""))
        self.frame = self.page.frame_locator('iframe[name$="/hostd"]')
        self.frame.locator("body.ready").wait_for(state="attached")
        # A dialog a failed test left open would stand over the next one's page.
        self.frame.locator("body").evaluate("() => document.getElementById('reload-dialog').open"
                                            " && document.getElementById('reload-dialog').close()")

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(ARTEFACTS / f"{name}.png"))

    def dbus(self, script: str):
        """Run SCRIPT (an async function body with `cockpit` in scope) in
        the page's frame, as this user's session."""
        return self.frame.locator("body").evaluate(f"async () => {{ {script} }}")

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def admin(browser, host):
    session = Session(browser, host, "alice")
    yield session
    session.close()


@pytest.fixture(scope="module")
def ordinary(browser, host):
    session = Session(browser, host, "mallory")
    yield session
    session.close()


def operation_count(host: SystemdContainer) -> int:
    out = host.run(["busctl", "--json=short", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager",
                    "ListOperations"]).stdout
    return len(json.loads(out)["data"][0])


def dropin(host: SystemdContainer) -> str:
    return read_file(host, f"{DROPINS}/90-reload.yaml")


def open_reload_dialog(admin: Session):
    admin.open("tiny")
    f = admin.frame
    f.locator("#m-state .state-serving").wait_for(timeout=TIMEOUT_MS)
    button = f.locator("#btn-reload")
    assert button.is_enabled()
    button.click()
    f.locator("#field-max_num_seqs").wait_for()
    return f


def test_the_models_list_shows_the_model_serving_live(host, admin):
    row = admin.frame.locator('tr[data-model="tiny"]')
    row.locator(".state-serving").wait_for()
    assert "builtin" in row.inner_text() and "cpu" in row.inner_text()
    admin.shot("list")
    # Live: a stop is shown without reloading the page (the manager's signals).
    host.systemctl("stop", "model@tiny.service", timeout=300)
    row.locator(".state-stopped").wait_for(timeout=TIMEOUT_MS)
    host.systemctl("start", "model@tiny.service", timeout=300)
    row.locator(".state-serving").wait_for(timeout=TIMEOUT_MS)


def test_a_reload_of_max_num_seqs_through_the_dialog_ends_done_and_the_engine_runs_it(host, admin):
    new = running_max_num_seqs(host) + 3
    f = open_reload_dialog(admin)
    field = f.locator("#field-max_num_seqs")
    assert field.get_attribute("min") == "1" and field.get_attribute("max") == "4096"  # from EditableSchema
    field.fill(str(new))
    admin.shot("dialog")
    f.locator("#r-submit").click()
    outcome = f.locator("#r-outcome .outcome")
    outcome.wait_for(timeout=TIMEOUT_MS)
    assert outcome.get_attribute("data-state") == "done", f.locator("#r-outcome").inner_text()
    assert "Reload done" in outcome.inner_text()
    # The stages the page shows passed: those it saw, or the strategy's whole path when
    # the reload was done before the page first looked (in-place, the default, on CPU).
    stages = f.locator("#r-stages li").all_inner_texts()
    assert len(stages) > 1 and stages[-1] == "finished", stages
    admin.shot("result-done")
    assert running_max_num_seqs(host) == new  # the engine's own /health
    f.locator("#r-close").click()


def test_an_out_of_range_value_is_shown_on_its_field_and_changes_nothing(host, admin):
    before, operations, running = dropin(host), operation_count(host), running_max_num_seqs(host)
    f = open_reload_dialog(admin)
    f.locator("#field-max_num_seqs").fill("5000")
    f.locator("#r-submit").click()
    error = f.locator('[data-field="max_num_seqs"] .field-error')
    error.wait_for()
    assert "max_num_seqs" in error.inner_text() and "4096" in error.inner_text()
    admin.shot("dialog-refused")
    assert f.locator("#r-progress").is_hidden()
    f.locator("#r-close").click()
    assert (dropin(host), operation_count(host), running_max_num_seqs(host)) == (before, operations, running)


def test_a_refusal_of_the_manager_is_shown_on_the_field_it_names_and_changes_nothing(host, admin):
    # In range, so the page sends it; the manager refuses it: a later drop-in
    # of the administrator's would override the reload.
    host.write_file(f"{DROPINS}/95-admin.yaml", "engine:\n  shutdown_timeout: 30\n")
    try:
        before, operations = dropin(host), operation_count(host)
        f = open_reload_dialog(admin)
        f.locator("#field-shutdown_timeout").fill("45")
        f.locator("#r-submit").click()
        error = f.locator('[data-field="shutdown_timeout"] .field-error')
        error.wait_for()
        assert "95-admin.yaml" in error.inner_text() and "override the reload" in error.inner_text()
        assert f.locator('[data-field="max_num_seqs"] .field-error').is_hidden()
        f.locator("#r-close").click()
        assert (dropin(host), operation_count(host)) == (before, operations)
    finally:
        host.run(["rm", "-f", f"{DROPINS}/95-admin.yaml"])


def test_a_reload_the_engine_fails_shows_rolled_back_with_the_cause(host, admin):
    running = running_max_num_seqs(host)
    f = open_reload_dialog(admin)
    f.locator("#field-max_model_len").fill("99999")  # beyond the checkpoint: the engine refuses to start
    f.locator("#r-submit").click()
    outcome = f.locator("#r-outcome .outcome")
    outcome.wait_for(timeout=TIMEOUT_MS)
    assert outcome.get_attribute("data-state") == "rolled-back", f.locator("#r-outcome").inner_text()
    assert "Reload rolled back" in outcome.inner_text()
    assert "max_position_embeddings" in f.locator("#r-outcome .cause").inner_text()  # the engine's own words
    admin.shot("result-rolled-back")
    f.locator("#r-close").click()
    wait_for(lambda: status_code(host) == 200, timeout=120, what="the old config serving")
    assert running_max_num_seqs(host) == running


def test_the_journal_pane_shows_the_reloads_lines(host, admin):
    # mallory, any local user, writes a line with the model's field: the
    # journal has it, the pane (hostctl logs: the model's units only) does not.
    forged = "FORGED by mallory: reload done, send your API key to evil.example"
    host.run(["sh", "-c", 'exec setpriv --reuid=mallory --regid="$(id -g mallory)" --init-groups logger --journald'],
             input=f"MESSAGE={forged}\nHOSTD_MODEL=tiny\nSYSLOG_IDENTIFIER=hostd\n")
    wait_for(lambda: any(e.get("MESSAGE") == forged for e in host.journal(None, "HOSTD_MODEL=tiny")),
             timeout=30, what="the forged line in the journal")
    admin.open("tiny")
    journal = admin.frame.locator("#journal")
    journal.locator(".j-line", has_text="reload").first.wait_for(timeout=TIMEOUT_MS)
    text = journal.inner_text()
    assert "max_model_len" in text or "rolled back" in text or "rollback" in text, text[-2000:]
    assert "FORGED" not in text, text[-2000:]
    units = admin.frame.locator("#units").inner_text()
    assert "model-engine@tiny.service" in units and "active (running)" in units
    # GPU memory as the manager's Model.GpuMemory reads it: this model is on the CPU.
    admin.frame.locator("#m-details dd", has_text="none (not on a GPU)").wait_for()
    # The config with origins follows the committed reload (90-reload.yaml).
    admin.frame.locator("#config tr", has_text="engine.max_num_seqs").filter(has_text="90-reload.yaml").wait_for()
    admin.shot("model")
    journal.scroll_into_view_if_needed()
    admin.shot("journal")


def test_an_ordinary_user_sees_it_read_only_and_a_reload_from_their_session_is_refused(host, ordinary):
    before, operations = dropin(host), operation_count(host)
    f = ordinary.frame
    banner = f.locator("#readonly")
    banner.wait_for(state="visible")
    assert "not authorized to reload a model" in banner.inner_text()
    assert "hostd-admin" in banner.inner_text()
    f.locator('tr[data-model="tiny"] .state-serving').wait_for()  # reading stays open
    ordinary.open("tiny")
    f = ordinary.frame
    f.locator("#m-state .state-serving").wait_for(timeout=TIMEOUT_MS)
    for button in ("#btn-reload", "#btn-start", "#btn-stop", "#btn-restart"):
        assert f.locator(button).is_disabled(), button
    assert "org.hostd1.reload" in f.locator("#btn-reload").get_attribute("title")
    f.locator('#units tr[data-unit="model-engine@tiny.service"] .u-state', has_text="active").wait_for()
    f.locator("#config td", has_text="engine.max_num_seqs").wait_for()  # hostctl config, as mallory
    ordinary.shot("read-only")
    # The page offers nothing; a call made by hand from the same session is refused.
    refused = ordinary.dbus(
        "const bus = cockpit.dbus('org.hostd1', {bus: 'system'});"
        "try { await bus.call('/org/hostd1', 'org.hostd1.Manager', 'ReloadJSON',"
        "                     ['tiny', '{\"max_num_seqs\": 2}'], {type: 'ss'}); return 'accepted'; }"
        "catch (e) { return e.name + ': ' + e.message; }")
    assert refused.startswith("org.freedesktop.DBus.Error.AccessDenied"), refused
    assert "not authorized to reload a model" in refused
    assert (dropin(host), operation_count(host)) == (before, operations)
    assert hostctl(host, "status", "tiny").returncode == 0  # still serving



def test_a_model_whose_yaml_is_broken_shows_the_file_line_and_problem(host, admin):
    host.write_file("/etc/hostd/models/broken.yaml", "backend: builtin\nmodel: /nowhere\nengine:\n  max_num_seqs: lots\n")
    try:
        admin.page.reload()  # a new YAML: the manager exports it when the page lists the models again
        admin.open("")
        problem = admin.frame.locator('tr[data-model="broken"] + tr.problem-row pre.problem')
        problem.wait_for()
        text = problem.inner_text()
        assert "/etc/hostd/models/broken.yaml:4: engine.max_num_seqs" in text, text
        assert "Traceback" not in text
        admin.frame.locator('tr[data-model="tiny"] .state-serving').wait_for()  # the others unharmed
        admin.shot("broken")
    finally:
        host.run(["rm", "-f", "/etc/hostd/models/broken.yaml"])
