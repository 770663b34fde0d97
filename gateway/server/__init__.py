"""The HTTP server beneath the app: uvicorn's httptools protocol with bounded reads, the worker
processes and the hand-off of a listening socket between them."""
