"""The Tinker training API (the `tinker` SDK's wire protocol), served by `molt serve` under /tinker: docs/tinker.md."""
import asyncio
import importlib


def mounted(records, auth, concurrency: int | None = None, gpus: list[str] | None = None):
    """The ASGI app for /tinker, built at its first request: torch, transformers and the SDK's protobuf messages
    are imported only by a dashboard that serves a Tinker client, and off the event loop (on a
    busy machine that takes seconds, which the dashboard's other requests must not wait for)."""
    built, lock = [], asyncio.Lock()

    async def app(scope, receive, send):
        async with lock:
            if not built:
                api = await asyncio.to_thread(importlib.import_module, ".api", __name__)
                built.append(api.create(records, auth, concurrency, gpus))
        await built[0](scope, receive, send)
    return app
