"""The README's tour: one streamed request through a running gateway (`make run`), then the
headers that say how it was routed. `make tour` runs it."""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")
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
