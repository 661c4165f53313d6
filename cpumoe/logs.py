"""The `cpumoe` logger. CPUMOE_LOG=info (or debug, warning) prints its records to stderr without any
logging set-up by the application."""
import logging
import os

logger = logging.getLogger("cpumoe")


def configure_from_env() -> None:
    level = os.environ.get("CPUMOE_LOG")
    if not level or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
