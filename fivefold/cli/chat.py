"""``fivefold chat``: an interactive chat."""

from __future__ import annotations

import sys

from fivefold.cli import common
from fivefold.errors import FivefoldError


def add_parser(sub) -> None:
    """``fivefold chat``'s arguments."""
    chat = sub.add_parser("chat", help="interactive chat with history (/reset, /exit)")
    common.add_model_args(chat)
    chat.add_argument("--system", default=None)
    common.add_sampling_args(chat, max_tokens=256)


def run(args) -> int:
    params = common.sampling(args)
    llm = common.llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    print("fivefold chat: type a message; /reset clears the history, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = []
        try:
            for out in llm.stream(llm.chat_prompt(system + history), params):
                reply.append(out.delta_text)
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
        except FivefoldError as exc:  # e.g. the history outgrew the context: say so, keep the session
            history.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
