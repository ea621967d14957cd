"""A small client of the text generation server's ``PUT /api`` (Megatron's tools/text_generation_cli.py).

    python tools/text_generation_cli.py localhost:5000                 # asks for prompts until end of input
    python tools/text_generation_cli.py localhost:5000 --prompt "To be" --tokens-to-generate 20

Interactively it asks for a prompt and a number of tokens, prints the server's text (prompt plus generation),
and asks again; Ctrl-D (end of input) quits. An error answer prints its status and message and does not stop the
loop. Uses only the standard library.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request


def generate(url: str, prompt: str, tokens_to_generate: int, timeout: float = 600.0) -> str:
    """The text the server at ``url`` (``host:port`` or ``http://host:port``) returns for one prompt."""
    base = url if url.startswith(("http://", "https://")) else f"http://{url}"
    body = json.dumps({"prompts": [prompt], "tokens_to_generate": tokens_to_generate}).encode("utf-8")
    request = urllib.request.Request(
        f"{base.rstrip('/')}/api", data=body, method="PUT", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())["text"][0]
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        raise RuntimeError(f"Error {error.code}: {message}") from None
    except urllib.error.URLError as error:
        raise ConnectionError(
            f"{base}: cannot reach the text generation server ({error.reason}); is it running there? (start it "
            "with tools/run_text_generation_server.py)"
        ) from None


def _ask_tokens() -> int:
    while True:
        answer = input("Enter number of tokens to generate: ").strip()
        try:
            return int(answer)
        except ValueError:
            print(f"not a number: {answer!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server, as host:port (e.g. localhost:5000)")
    parser.add_argument("--prompt", help="generate for this prompt once and exit")
    parser.add_argument("--tokens-to-generate", type=int, default=64, help="with --prompt (default 64)")
    args = parser.parse_args(argv)
    if args.prompt is not None:
        try:
            print(generate(args.url, args.prompt, args.tokens_to_generate))
        except (RuntimeError, ConnectionError) as error:
            # The client is standard library only, so it prints megatron's one-line error format itself.
            print(f"error: {error}", file=sys.stderr)
            return 1
        return 0
    while True:
        try:
            prompt = input("Enter prompt: ")
            tokens = _ask_tokens()
        except EOFError:
            print()
            return 0
        try:
            text = generate(args.url, prompt, tokens)
        except (RuntimeError, ConnectionError) as error:
            print(f"error: {error}")
            continue
        print("Megatron Response: ")
        print(text)


if __name__ == "__main__":
    sys.exit(main())
