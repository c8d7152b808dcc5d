"""`kvrelay up`: start the local stack, say where the gateway listens, run until Ctrl-C or
SIGTERM (or until a service dies), then stop everything that was started."""

from __future__ import annotations

import signal
import time
from types import FrameType

from rich.console import Console

from services.launcher.stack import ServiceProcess, Stack, StackConfig, StackError


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_up(config: StackConfig, console: Console | None = None) -> int:
    """Blocks until interrupted; returns the process exit code (1 if a service died)."""
    console = console or Console()
    stack = Stack(config)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack like Ctrl-C does
    console.print(f"starting the kvrelay stack from {config.checkpoint} (logs in {stack.log_dir})")

    def ready(service: ServiceProcess) -> None:
        console.print(f"  [green]ready[/green] {service.name:<10} {service.address:<22} pid {service.pid}")

    started = time.monotonic()
    try:
        stack.start(on_ready=ready)
        console.print(f"[bold]kvrelay gateway listening on {stack.gateway_address}[/bold]")
        console.print(f"  ready in {time.monotonic() - started:.1f} s")
        console.print(f'  try: kvrelay generate "What is the capital of France?" --chat --gateway {stack.gateway_address}')
        console.print("  Ctrl-C stops every service")
        return _watch(stack, console)
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


def _watch(stack: Stack, console: Console) -> int:
    while True:
        time.sleep(0.5)
        dead = stack.dead()
        if dead:
            for service in dead:
                console.print(f"[red]{service.name} exited unexpectedly[/red]; last log lines:\n{service.log_tail()}")
            return 1
