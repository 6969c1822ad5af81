"""Human model names and ``kvasird chat`` against the module's real daemon: the names the
gateway lists and accepts, the banner's request, and the chat's line editing, history and
commands (through a pseudo-terminal, and through prompt_toolkit's pipe input)."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_daemon import Daemon
from prompt_toolkit import PromptSession
from prompt_toolkit.history import InMemoryHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from kvasird.cli.chat import Chat, edited_lines, listed_models
from kvasird.config import default_text, render
from kvasird.daemon.banner import print_banner
from tests.support import eventually

pytestmark = pytest.mark.slow  # a real daemon per module

NAME, SLUG = "smollm2:135m-instruct", "smollm2-135m-instruct"
WAIT_S = 60.0
UP = "\x1b[A"
PROMPT = "\n>"
"""The chat's prompt as a terminal shows it, once escape sequences are gone."""
ANSI = re.compile(rb"\x1b\[[0-9;?<>=]*[ -/]*[@-~]"  # cursor moves, colours, modes
                  rb"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[=>()][0-9A-B]?|[\r\x07\x08]")


def requests_served(daemon: Daemon) -> int:
    return int(httpx.get(daemon.url + "/status").json()["gateway"]["requests_served"])


def wait_served(daemon: Daemon, count: int) -> None:
    eventually(f"the gateway served {count} requests",
               lambda: requests_served(daemon) >= count, timeout=WAIT_S, every=0.05)


# --- names the gateway lists and accepts ------------------------------------------------


def test_models_lists_the_name_as_the_id_and_the_model_id_next_to_it(daemon: Daemon) -> None:
    [model] = httpx.get(daemon.url + "/v1/models").json()["data"]
    assert model["model_id"] == daemon.model and re.fullmatch("[0-9a-f]{64}", daemon.model)
    assert (model["id"], model["name"], model["slug"], model["label"]) == (NAME, NAME, SLUG, NAME)


@pytest.mark.parametrize("how", ["id", "id prefix", "name", "slug"])
def test_a_request_names_the_model_any_way_the_listing_shows(daemon: Daemon, how: str) -> None:
    name = {"id": daemon.model, "id prefix": daemon.model[:8], "name": NAME, "slug": SLUG}[how]
    r = httpx.post(daemon.url + "/v1/chat/completions", timeout=WAIT_S, json={
        "model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == name


def banner_lines(daemon: Daemon) -> list[str]:
    """The banner as lines of text: printed, or its JSON event's fields as the lines."""
    lines: list[str] = []
    for line in daemon.node.log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            lines.append(line)
            continue
        if isinstance(event, dict) and event.get("event") == "banner":
            lines += [f"model        {event['model']}", event["ask"]]
    return lines


def test_the_banner_shows_the_name_and_a_request_that_works(daemon: Daemon) -> None:
    lines = banner_lines(daemon)
    assert f"model        {NAME}" in lines
    curl = next(line for line in lines if line.lstrip().startswith("curl "))
    url = re.search(r"curl -s (\S+)", curl)
    body = re.search(r"-d '(.*)'$", curl)
    assert url and body, curl
    assert url[1] == daemon.url + "/v1/chat/completions"
    assert json.loads(body[1])["model"] == NAME
    r = httpx.post(url[1], content=body[1], headers={"content-type": "application/json"},
                   timeout=WAIT_S)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("model", "gateway", "shown"), [
    ("a" * 64, "http://127.0.0.1:8080", "a" * 64), ("", "http://127.0.0.1:8080", None),
    ("bundled:smollm2", "", None)])
def test_the_banner_names_the_model_a_request_can_give(
        model: str, gateway: str, shown: str | None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A model id is the name until its GGUF arrives; no model or no gateway, no request."""
    config = tmp_path / "kvasird.toml"
    config.write_text(render(default_text(), {"market.model": model}))
    status = {"version": "0", "peer_id": "p", "network": "n", "listen_addrs": [],
              "join_addr": "", "gateway": gateway}
    print_banner(status, "http://127.0.0.1:5001", str(config))
    out = capsys.readouterr().out
    assert (f"model        {shown}\n" in out) if shown else "curl" not in out
    assert "ready" not in out.splitlines()  # said later, once the node serves


# --- the chat through prompt_toolkit's pipe input ---------------------------------------


@pytest.fixture
def chat(daemon: Daemon) -> Iterator[Chat]:
    args = argparse.Namespace(system="Answer briefly.", temperature=0.0, max_tokens=3, seed=1)
    with httpx.Client(base_url=daemon.url, timeout=WAIT_S) as http:
        yield Chat(http, args, listed_models(http)[0])


def converse(chat: Chat, *lines: str) -> list[list[dict[str, str]]]:
    """Type each of ``lines`` at a prompt of the chat, as a person would, then Ctrl-D; the
    conversation as it stood at each prompt."""
    seen: list[list[dict[str, str]]] = []
    keys = list(lines)
    with create_pipe_input() as keyboard:
        read = edited_lines(PromptSession(input=keyboard, output=DummyOutput(),
                                          history=InMemoryHistory()))

        def prompt() -> str | None:
            seen.append([dict(m) for m in chat.messages])
            if keys:
                keyboard.send_text(keys.pop(0))
            else:
                keyboard.close()
            return read()

        chat.loop(prompt)
    return seen


def users(history: list[dict[str, str]]) -> list[str]:
    return [m["content"] for m in history if m["role"] == "user"]


def test_up_arrow_recalls_the_last_line(chat: Chat) -> None:
    seen = converse(chat, "Say hi\r", f"{UP}\r")
    assert users(seen[-1]) == ["Say hi", "Say hi"]
    assert [m["role"] for m in seen[-1]] == ["system", "user", "assistant", "user", "assistant"]


def test_reset_forgets_the_conversation_but_not_the_system_prompt(chat: Chat) -> None:
    seen = converse(chat, "Say hi\r", "/reset\r")
    assert users(seen[1]) == ["Say hi"]
    assert seen[2] == [{"role": "system", "content": "Answer briefly."}]


def test_commands_are_never_sent_to_the_model(chat: Chat, daemon: Daemon,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    served = requests_served(daemon)
    seen = converse(chat, "/help\r", "/nonsense now\r", "/model\r")
    assert requests_served(daemon) == served
    assert all(users(h) == [] for h in seen)
    err = capsys.readouterr().err
    assert "/reset" in err and "/model [NAME]" in err and "/quit" in err
    assert "there is no command /nonsense: /help lists them" in err
    assert f"chatting with {NAME} (id {chat.model.id[:12]})" in err


def test_model_switches_only_to_a_model_the_gateway_serves(
        chat: Chat, capsys: pytest.CaptureFixture[str]) -> None:
    before = chat.model
    converse(chat, "/model gpt-4o\r")
    assert chat.model == before
    assert f"the gateway serves no model 'gpt-4o': it serves {NAME}" in capsys.readouterr().err
    converse(chat, f"/model {NAME}\r")
    assert chat.model == before
    assert f"now chatting with {NAME}" in capsys.readouterr().err


def test_a_refused_line_is_told_and_left_out_of_the_conversation(
        chat: Chat, capsys: pytest.CaptureFixture[str]) -> None:
    chat.args.max_tokens = 0
    seen = converse(chat, "Say hi\r", "/help\r")
    assert seen[1] == seen[0] == [{"role": "system", "content": "Answer briefly."}]
    assert "`max_tokens` must be at least 1" in capsys.readouterr().err


def test_quit_ends_the_chat_before_the_next_line(chat: Chat, daemon: Daemon) -> None:
    served = requests_served(daemon)
    assert len(converse(chat, "/quit\r", "Say hi\r")) == 1
    assert requests_served(daemon) == served


# --- the chat as a person runs it: a terminal, and a pipe -------------------------------


class Terminal:
    """``kvasird chat`` on a pseudo-terminal: keys in, the screen's text out."""

    def __init__(self, argv: list[str]) -> None:
        self.fd, child = os.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
        self.proc = subprocess.Popen(argv, stdin=child, stdout=child, stderr=child, env=env,
                                     start_new_session=True)
        os.close(child)
        self.screen = b""
        self.at = 0

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def expect(self, text: str) -> None:
        """Wait until ``text`` shows after what the last expect found."""
        deadline = time.monotonic() + WAIT_S
        while (found := ANSI.sub(b"", self.screen).find(text.encode(), self.at)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} never showed; the screen:\n{self.text()}"
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    self.screen += os.read(self.fd, 65536)
                except OSError:  # the chat exited and the terminal closed
                    raise AssertionError(f"{text!r} never showed; the chat exited; the "
                                         f"screen:\n{self.text()}") from None
        self.at = found + len(text)

    def text(self) -> str:
        return ANSI.sub(b"", self.screen).decode(errors="replace")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the chat did not exit; the screen:\n{self.text()}") from None

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.fd)


def chat_command(daemon: Daemon, home: Path) -> list[str]:
    return [sys.executable, "-m", "kvasird", "--home", str(home), "chat", "--url", daemon.url,
            "--temperature", "0", "--max-tokens", "3"]


@pytest.mark.slow
def test_a_terminal_chat_recalls_lines_with_the_arrow_keys_across_runs(
        daemon: Daemon, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    served = requests_served(daemon)
    with Terminal(chat_command(daemon, home)) as term:
        term.expect(f"chatting with {NAME} at {daemon.url}")
        term.expect(PROMPT)
        term.send("/help\r")
        term.expect("/model [NAME]")
        term.expect(PROMPT)
        term.send("/wat\r")
        term.expect("there is no command /wat")
        term.expect(PROMPT)
        assert requests_served(daemon) == served
        term.send("Say hi\r")
        wait_served(daemon, served + 1)
        term.expect(PROMPT)
        term.send(UP)
        term.expect("Say hi")
        term.send("\r")
        wait_served(daemon, served + 2)
        term.expect(PROMPT)
        term.send("/quit\r")
        assert term.wait() == 0, term.text()
    assert "^[[A" not in term.text()
    typed = [line[1:] for line in (home / "chat_history").read_text().splitlines()
             if line.startswith("+")]
    assert typed == ["/help", "/wat", "Say hi", "/quit"]
    with Terminal(chat_command(daemon, home)) as term:
        term.expect(PROMPT)
        term.send(UP * 2)
        term.expect("Say hi")
        term.send("\x03")  # Ctrl-C drops the line; Ctrl-D on an empty one leaves
        term.expect(PROMPT)
        term.send("\x04")
        assert term.wait() == 0, term.text()


@pytest.mark.slow
def test_a_piped_chat_reads_plain_lines(daemon: Daemon, tmp_path: Path) -> None:
    served = requests_served(daemon)
    done = subprocess.run(chat_command(daemon, tmp_path / "no-home"), input="/help\nSay hi\n",
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert requests_served(daemon) == served + 1
    assert "/reset" in done.stderr and done.stdout.strip()
    assert not (tmp_path / "no-home").exists()
