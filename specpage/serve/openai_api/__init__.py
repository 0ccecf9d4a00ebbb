"""The OpenAI-compatible HTTP API: request bodies (`protocol`), errors (`errors`),
response objects (`render`), routes (`app`) and uvicorn in the daemon's loop
(`listener`). Requests go through the same `specpage.serve.frontend.Frontend` as gRPC."""
