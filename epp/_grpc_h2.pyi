"""Types of the native module built from native/grpc_h2 (see its src/lib.rs)."""

from collections.abc import Sequence

NEW: int
MESSAGE: int
END: int
CLOSED: int
TOO_LARGE: int
COMPRESSED: int

class GrpcConnection:
    def __init__(
        self,
        *,
        max_concurrent_streams: int,
        max_message: int,
        window: int,
        max_frame_size: int,
        max_header_list_size: int,
    ) -> None: ...
    def receive(self, data: bytes) -> list[tuple[int, int, bytes | None]]: ...
    def take_events(self) -> list[tuple[int, int, bytes | None]]: ...
    def send(self, id: int, payloads: Sequence[bytes]) -> None: ...
    def finish(self, id: int, code: int, message: str) -> None: ...
    def data_to_send(self) -> bytes: ...
    def goaway(self) -> None: ...
    def __len__(self) -> int: ...
