"""The gateway: pdserve's public edge (OpenAI-compatible HTTP and gRPC ``Generate``).

Modules: ``config`` (settings), ``backend`` (what runs generations: the protocol),
``engine_backend`` (in-process engine), ``served_model`` (tokenize, template, limits),
``openai_api`` / ``openai_responses`` (OpenAI request parsing, response shapes),
``http_server`` and ``grpc_server`` (+ ``grpc_convert``) (the edges), ``service`` (state
both edges share), ``metrics``, ``__main__`` (the process, through the shell in
``services.common.process``).
"""
