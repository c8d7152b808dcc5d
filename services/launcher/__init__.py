"""Local deployments: `kvrelay up` (the whole stack as separate processes), `kvrelay demo`
(the stack answering one needle question under two policies) and `kvrelay bench e2e`."""

from services.launcher.stack import ServiceProcess, Stack, StackConfig, StackError, WorkerPorts

__all__ = ["ServiceProcess", "Stack", "StackConfig", "StackError", "WorkerPorts"]
