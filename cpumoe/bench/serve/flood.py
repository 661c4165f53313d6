"""A flood server: answers every HTTP request with an SSE stream of N completion events, as fast as the socket
takes them. The client's ceiling is measured against it (ceiling.py).

Run as a script by its path (`python flood.py CHUNKS`), so it imports the standard library only, not cpumoe (and
so not torch); it prints its loopback port on stdout, then serves until killed.
"""
import asyncio
import sys

EVENT = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"flood",'
         b'"choices":[{"index":0,"text":" tok","finish_reason":null,"logprobs":null}]}\n\n')
BLOCK_EVENTS = 256     # events per socket write


async def serve(chunks: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        block = EVENT * BLOCK_EVENTS
        for _ in range(chunks // BLOCK_EVENTS):
            writer.write(block)
            await writer.drain()
        writer.write(EVENT * (chunks % BLOCK_EVENTS) + b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
