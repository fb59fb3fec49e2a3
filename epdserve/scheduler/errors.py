"""`RequestError`: why a public request failed, as the gRPC status code the client receives.

Only these codes reach clients: INVALID_ARGUMENT (bad media, bad parameters),
RESOURCE_EXHAUSTED (queues full), NOT_FOUND (an upload's file id: uploads.py), UNAVAILABLE (no healthy instance of a needed role, or every
retry used up), DEADLINE_EXCEEDED, CANCELLED. `InstanceError` is one instance's failure inside
the system; `classify` says what the scheduler does about it.
"""
from __future__ import annotations

import enum

import grpc


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def invalid(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def unavailable(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)

    @classmethod
    def not_found(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.NOT_FOUND, message)

    @classmethod
    def exhausted(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class Action(enum.Enum):
    FAIL = "fail"  # the request is bad: fail it with INVALID_ARGUMENT
    RETRY_DEAD = "retry_dead"  # the instance looks dead: count a health failure, retry elsewhere
    RETRY = "retry"  # transient (e.g. KV transfer failed): retry, same instance allowed
    BUSY = "busy"  # the instance is full: try another one
    DEADLINE = "deadline"


_ACTIONS = {
    grpc.StatusCode.INVALID_ARGUMENT: Action.FAIL,
    grpc.StatusCode.FAILED_PRECONDITION: Action.FAIL,
    grpc.StatusCode.OUT_OF_RANGE: Action.FAIL,
    grpc.StatusCode.NOT_FOUND: Action.FAIL,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Action.BUSY,
    grpc.StatusCode.DEADLINE_EXCEEDED: Action.DEADLINE,
    grpc.StatusCode.UNAVAILABLE: Action.RETRY_DEAD,
    grpc.StatusCode.CANCELLED: Action.RETRY_DEAD,  # we cancel our own calls only when the request ends
    grpc.StatusCode.UNKNOWN: Action.RETRY_DEAD,
    grpc.StatusCode.DATA_LOSS: Action.RETRY_DEAD,
}


class InstanceError(Exception):
    """An RPC to one instance failed (or its stream ended without finishing the request)."""

    def __init__(self, instance_id: str, stage: str, code: grpc.StatusCode, message: str):
        super().__init__(f"{stage} on {instance_id}: {code.name}: {message}")
        self.instance_id = instance_id
        self.stage = stage
        self.code = code
        self.message = message

    @property
    def action(self) -> Action:
        return _ACTIONS.get(self.code, Action.RETRY)  # ABORTED, INTERNAL, ...

    @classmethod
    def from_rpc(cls, instance_id: str, stage: str, err: grpc.aio.AioRpcError) -> InstanceError:
        return cls(instance_id, stage, err.code(), err.details() or "")
