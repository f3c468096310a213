"""Round-robin router over several OpenAI-compatible replicas (ours, SGLang or vLLM).

    python -m benchmark.serving.router --replicas http://127.0.0.1:30001,http://127.0.0.1:30002 --port 30000

Completion requests go to the replicas in turn (streaming passes through chunk by chunk); /v1/models
is the first replica's; /health is ok when every replica answers. A replica that cannot be reached
gets a 502 in OpenAI's error shape and the next request goes to the next replica.
"""

from __future__ import annotations

import argparse
import itertools

import httpx2 as httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inference.server_defaults import SERVER

HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host"}


def create_router(replicas: list[str], *, timeout: float = 600.0) -> FastAPI:
    if not replicas:
        raise ValueError("give at least one replica URL")
    replicas = [r.rstrip("/") for r in replicas]
    turn = itertools.cycle(range(len(replicas)))
    client = httpx.AsyncClient(timeout=timeout)
    app = FastAPI(title="bdstack router")
    app.state.replicas, app.state.sent = replicas, [0] * len(replicas)

    def headers(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}

    async def forward(request: Request, path: str):
        i = next(turn)
        app.state.sent[i] += 1
        url = replicas[i] + path
        body = await request.body()
        try:
            req = client.build_request(request.method, url, content=body, headers=headers(request))
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            return JSONResponse(
                {
                    "error": {
                        "message": f"replica {replicas[i]} unreachable: {e}",
                        "type": "server_error",
                        "param": None,
                        "code": "bad_gateway",
                    }
                },
                status_code=502,
            )
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        if resp.headers.get("content-type", "").startswith("text/event-stream"):

            async def relay():
                try:
                    async for part in resp.aiter_raw():
                        yield part
                finally:
                    await resp.aclose()

            return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)
        data = await resp.aread()
        await resp.aclose()
        return Response(data, status_code=resp.status_code, headers=out_headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        resp = await client.get(replicas[0] + "/v1/models", headers=headers(request))
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        states = {}
        for r in replicas:
            try:
                states[r] = (await client.get(r + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                states[r] = False
        return JSONResponse(
            {"status": "ok" if all(states.values()) else "degraded", "replicas": states},
            status_code=200 if all(states.values()) else 503,
        )

    return app


def main(argv=None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", required=True, help="comma-separated base URLs (without /v1)")
    p.add_argument("--host", default=SERVER.host)
    p.add_argument("--port", type=int, default=SERVER.port)
    args = p.parse_args(argv)
    uvicorn.run(create_router(args.replicas.split(",")), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
