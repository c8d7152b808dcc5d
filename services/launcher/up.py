"""`kvrelay up`: start the local stack, say where the gateway listens, run until Ctrl-C or
SIGTERM, then stop everything that was started. A service that dies meanwhile is restarted
(services.launcher.supervise); the stack stops only when it can no longer serve."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType

from rich.console import Console
from rich.markup import escape

from services.launcher.stack import ServiceProcess, Stack, StackConfig, StackError
from services.launcher.supervise import Event, RestartPolicy, Supervisor


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_up(config: StackConfig, console: Console | None = None, restarts: RestartPolicy | None = None) -> int:
    """Blocks until interrupted; returns the process exit code (1 if the stack broke down)."""
    console = console or Console()
    stack = Stack(config)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack like Ctrl-C does
    console.print(f"starting the kvrelay stack from {config.checkpoint} (logs in {stack.log_dir})")

    def ready(service: ServiceProcess) -> None:
        # `ready <name> <address> pid <pid>`: tests and scripts read this line (a restart repeats it).
        console.print(f"  [green]ready[/green] {service.name:<10} {service.address:<22} pid {service.pid}")

    started = time.monotonic()
    try:
        stack.start(on_ready=ready)
        console.print(f"[bold]kvrelay gateway listening on {stack.gateway_address}[/bold]")
        if stack.http_url:
            console.print(f"  OpenAI-compatible HTTP API on {stack.http_url}/v1")
        console.print(f"  ready in {time.monotonic() - started:.1f} s")
        tls = config.tls_dir
        flags = "" if tls is None else f" --tls-ca {tls / 'ca.pem'}"
        if tls is not None:
            console.print(f"  mutual TLS between every service; certificates in {tls}")
        console.print(f'  try: kvrelay generate "What is the capital of France?" --chat --gateway {stack.gateway_address}{flags}')
        console.print("  Ctrl-C stops every service")
        return _watch(Supervisor(stack, restarts), console, ready)
    except KeyboardInterrupt:
        return 0
    except StackError as exc:
        console.print(f"[red]the stack did not start:[/red] {exc}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        console.print("stopping the kvrelay stack")
        stack.stop()


def _watch(supervisor: Supervisor, console: Console, ready: Callable[[ServiceProcess], None]) -> int:
    while True:
        time.sleep(0.5)
        for event in supervisor.poll():
            _report(event, console, ready)
        broken = supervisor.broken()
        if broken:
            console.print(f"[red]the stack cannot serve any more:[/red] {'; '.join(broken)}")
            return 1


def _report(event: Event, console: Console, ready: Callable[[ServiceProcess], None]) -> None:
    name = event.service.name
    if event.kind == "exited":
        console.print(f"[red]{name} exited unexpectedly ({event.detail})[/red]; last log lines:\n"
                      f"{escape(event.service.log_tail())}")
    elif event.kind == "restarting":
        console.print(f"  restarting {name} {event.detail}")
    elif event.kind == "restarted":
        console.print(f"  restarted {name} ({event.detail}), pid {event.service.pid}")
    elif event.kind == "ready":
        ready(event.service)
    elif event.kind == "given_up":
        console.print(f"[red]{name} keeps exiting ({event.detail}); not restarting it[/red]")
