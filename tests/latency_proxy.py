"""A TCP forwarder on loopback that adds latency to every HTTP request (and optionally caps the bandwidth of
the answers): what a store 10-50 ms away looks like, for the shard cache's tests and measurements.

    python tests/latency_proxy.py --upstream 127.0.0.1:45200 --port 45300 --delay-ms 20 [--rate-mb 50]
    AWS_ENDPOINT_URL=http://127.0.0.1:45300 dali-bench --shards s3://... ...

Each request waits `delay` before it is forwarded (a request is the first bytes a client sends after an
answer, so a keep-alive connection pays it per request, as a real store's first-byte latency); with
`--rate-mb`, answers are forwarded at most that fast. Nothing is parsed or changed.
"""

from __future__ import annotations

import argparse
import asyncio


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_chunk) -> None:
    try:
        while chunk := await reader.read(2**16):
            await on_chunk(chunk)
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def handler(upstream: tuple[str, int], delay_s: float, rate: float | None):
    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(*upstream)
        except OSError:
            client_writer.close()
            return
        state = {"new_request": True}

        async def request_chunk(chunk):
            if state["new_request"]:
                state["new_request"] = False
                await asyncio.sleep(delay_s)

        async def answer_chunk(chunk):
            state["new_request"] = True
            if rate:
                await asyncio.sleep(len(chunk) / rate)

        await asyncio.gather(pipe(client_reader, server_writer, request_chunk),
                             pipe(server_reader, client_writer, answer_chunk))

    return handle


async def serve(port: int, upstream: tuple[str, int], delay_s: float, rate: float | None) -> None:
    server = await asyncio.start_server(handler(upstream, delay_s, rate), "127.0.0.1", port)
    print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)  # the endpoint, for the caller
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="host:port of the store")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one; printed)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="added before each request")
    parser.add_argument("--rate-mb", type=float, default=None, help="cap on the answers' bandwidth, MB/s")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    rate = args.rate_mb * 1e6 if args.rate_mb else None
    asyncio.run(serve(args.port, (host, int(port)), args.delay_ms / 1000, rate))


if __name__ == "__main__":
    main()
