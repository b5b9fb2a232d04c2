"""A TCP proxy on 127.0.0.1 that delays every reply from the broker, like a slow broker.

Requests go through at once; each chunk the broker sends back is held for ``delay_s`` before
it reaches the client, so every request takes at least that long to be answered. The broker
advertises the proxy's port, so all of a client's connections go through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from kafka_broker import free_port


class SlowProxy:
    def __init__(self, upstream_port: int, delay_s: float, port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.port = port if port is not None else free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> SlowProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self._server = future.result(10)
        return self

    async def _serve(self) -> asyncio.Server:
        return await asyncio.start_server(self._connection, "127.0.0.1", self.port)

    async def _connection(self, client_r: asyncio.StreamReader,
                          client_w: asyncio.StreamWriter) -> None:
        try:
            broker_r, broker_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self._pipe(client_r, broker_w, 0.0),
                             self._pipe(broker_r, client_w, self.delay_s))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    delay_s: float) -> None:
        try:
            while data := await reader.read(65536):
                if delay_s:
                    await asyncio.sleep(delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def stop(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> SlowProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
