"""An OpenAI-compatible HTTP server over `jax_sparse_kv.serving.Engine` (``python -m jax_sparse_kv serve``).

Needs the ``serve`` extra (``pip install -e ".[serve]"``: FastAPI, uvicorn, prometheus-client, jinja2,
tokenizers). Files, in the order a request flows:

- `protocol`: request / response models and OpenAI error objects;
- `tokenizer`: text <-> token ids (``tokenizer.json``), incremental detokenization, the chat template;
- `reasoning`: splits ``<think>...</think>`` text into ``reasoning_content`` (``--reasoning-parser``);
- `tool_parsers`: MiniMax-M3 / M2 tool-call markup into ``tool_calls`` (``--tool-call-parser``);
- `output`: one choice's text stream: detokenize, cut at stop strings, split reasoning, then tool calls;
  the stop check the engine thread runs (a request ends at the token that completes a stop string);
- `engine_thread`: the engine steps in its own thread; each request's outputs wait for its handler, merged;
- `metrics`: Prometheus metrics;
- `app`: the FastAPI app; `options`: ``serve``'s flags and their defaults (`ServeOptions`); `main`: the
  ``serve`` command; `connections`: the request-header deadline
  (``--header-timeout``) on uvicorn's HTTP protocol;
- `multihost`: ``serve`` over several processes (process 0 broadcasts each step's commands).

Only `reasoning`, `tool_parsers`, `output` and `options` import nothing outside the standard library.
"""
