"""`cpumoe bench serve`: a load generator for any OpenAI-compatible server (cpumoe, vLLM, llama-server).

    datasets.py  the prompts: random ones of exact token lengths, or a JSONL file
    client.py    streamed requests on a seeded arrival schedule, timed chunk by chunk (asyncio + aiohttp)
    metrics.py   TTFT, TPOT, ITL, E2E, throughput and goodput from the recorded timestamps (a pure function)
    run.py       one call: prompts once, a run per request rate; vLLM's result file and the database rows
    report.py    the printed table and notes
    ceiling.py   the client's own ceiling, against flood.py (a stand-alone flood server)
    cli.py       the argparse parser and handler
"""
