"""serve hands the gateway process its own flags, generated from the gateway's parser."""

from __future__ import annotations

import argparse

from services.gateway.service import add_gateway_args
from services.launcher import gateway_argv

CHANGED = (
    "--host 0.0.0.0 --port 8123 --allow-unauthenticated --max-queued-requests 7 "
    "--max-chat-messages 9 --request-timeout 30 --body-read-timeout 4.5 "
    "--header-read-timeout 3 --keepalive-timeout 2 --max-connections 11"
).split()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    return parser.parse_args(argv)


def test_every_gateway_flag_reaches_the_gateway_process_but_the_api_key():
    for argv in ([], CHANGED):
        args = _parse([*argv, "--api-key", "secret"])
        written = gateway_argv(args)
        assert "secret" not in written and "--api-key" not in written  # it goes by environment
        child = vars(_parse(written))
        assert child.pop("api_key") != "secret"
        assert child == {k: v for k, v in vars(args).items() if k != "api_key"}
