"""The README's tour: one streamed request through a running gateway (`make run`), then the
headers that say how it was routed. `make tour` runs it (the gateway's /v1 URL may be given)."""

import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1"
client = OpenAI(base_url=base_url, api_key="unused")
raw = client.chat.completions.with_raw_response.create(
    model="chat-large",
    messages=[{"role": "user", "content": "Why does p99 matter?"}],
    stream=True,
)
for chunk in raw.parse():
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
headers = ("x-tailguard-route", "x-tailguard-deployment", "x-tailguard-attempts", "server-timing")
for name in headers:
    print(f"\n{name}: {raw.headers[name]}", end="")
print()
