"""``agentrl-jax serve``: a Qwen3 checkpoint behind the OpenAI-compatible policy server.

    agentrl-jax serve --model-dir runs/grpo/models/grpo           # http://127.0.0.1:8000/v1
    agentrl-jax serve --model-dir MODEL --api-key "$KEY" --slots 64 --max-context 4096

Binds 127.0.0.1 unless ``--host`` says otherwise; with ``--api-key`` (or the environment
variable ``AGENTRL_JAX_API_KEY``) every request must carry ``Authorization: Bearer <key>``.
See :mod:`agentrl_jax.serve.server` for the endpoints and what each completion records.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer


def serve_command(
    model_dir: Path = typer.Option(
        ..., help="A Hugging Face Qwen3 directory (weights and tokenizer)."
    ),  # noqa: E501
    host: str = typer.Option("127.0.0.1", help="Address to bind (default: this machine only)."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port (0: any free one)."),
    api_key: Optional[str] = typer.Option(
        None, envvar="AGENTRL_JAX_API_KEY", help="Require this bearer key."
    ),  # noqa: E501
    model_name: str = typer.Option("policy", help="The model name clients ask for."),
    slots: int = typer.Option(32, min=1, max=4096, help="Rows decoded together."),
    max_context: int = typer.Option(4096, min=16, max=1 << 20, help="Tokens a conversation holds."),  # noqa: E501
    max_tokens: int = typer.Option(1024, min=1, help="The longest completion (and the default)."),
    chunk: int = typer.Option(
        16, min=1, max=1024, help="Tokens per decode call (requests join between calls)."
    ),  # noqa: E501
    max_queue: int = typer.Option(256, min=1, help="Requests waiting for rows before 429."),
    bfloat16: bool = typer.Option(False, help="Compute in bfloat16 (weights kept float32)."),
) -> None:
    """Serve a Qwen3 to agent programs over the OpenAI chat-completions API, recording each
    completion's exact tokens per episode (GET /v1/episodes/{id})."""
    import time

    import jax.numpy as jnp

    from agentrl_jax.models import load_qwen3
    from agentrl_jax.models.tokenizer import load_tokenizer
    from agentrl_jax.prompts import ChatTokens
    from agentrl_jax.serve import PolicyServer, ServingEngine, serve_in_thread

    if not model_dir.is_dir():
        raise typer.BadParameter(f"--model-dir {model_dir}: not a directory")
    try:
        model = load_qwen3(model_dir, dtype=jnp.bfloat16 if bfloat16 else jnp.float32)
        tokenizer = load_tokenizer(model_dir)
        engine = ServingEngine(
            model,
            stop_token_ids=ChatTokens(tokenizer).stop_token_ids,
            slots=slots,
            max_context=max_context,
            chunk=chunk,
            max_queue=max_queue,
        )
    except (OSError, ValueError) as error:
        raise typer.BadParameter(f"--model-dir {model_dir}: {error}") from None
    server = PolicyServer(
        engine,
        tokenizer,
        model_name=model_name,
        api_key=api_key or os.environ.get("AGENTRL_JAX_API_KEY") or None,
        max_tokens=min(max_tokens, max_context - 1),
    )
    with serve_in_thread(server, host, port) as url:
        typer.echo(f"serving {model_name!r} at {url} (Ctrl-C stops)")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            typer.echo("serve: stopped")
