"""Writes mooncake_synthetic.jsonl beside this file: a made-up trace in Mooncake's format (FAST'25 traces,
https://github.com/kvcache-ai/Mooncake, FAST25-release/traces) -- no line of it comes from Mooncake's data.

40 requests, ~2 per second: conversations that start on one of three shared 1024-token system prompts (hash ids
0-1, 2-3, 4-5) and later turns that keep the full 512-token blocks of their conversation's previous prompt (the
partial last block grows, so it gets a new id, as in Mooncake's traces, whose ids hash the prefix up to a block).
Run it again (``python tests/data/make_mooncake_synthetic.py``) and the file is the same.
"""

import json
import math
import random
from pathlib import Path

BLOCK = 512


def main() -> None:
    rng = random.Random(2025)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    systems = [fresh(2) for _ in range(3)]
    conversations: list[list] = []  # [hash_ids, input_length] of each conversation's latest turn
    lines, t = [], 0
    while len(lines) < 40:
        follow = [c for c in conversations if c[1] < 3000]
        if follow and rng.random() < 0.45:  # a later turn: the previous prompt, its reply, a new message
            c = rng.choice(follow)
            length = c[1] + rng.randint(150, 900)
            kept = c[1] // BLOCK
            c[0], c[1] = c[0][:kept] + fresh(math.ceil(length / BLOCK) - kept), length
            ids = c[0]
        else:  # a new conversation on one of the system prompts
            length = 2 * BLOCK + rng.randint(60, 1400)
            ids = rng.choice(systems) + fresh(math.ceil(length / BLOCK) - 2)
            conversations.append([ids, length])
        lines.append({"timestamp": t, "input_length": length, "output_length": rng.randint(16, 320),
                      "hash_ids": list(ids)})
        t += int(rng.expovariate(1 / 450))  # milliseconds
    out = Path(__file__).with_name("mooncake_synthetic.jsonl")
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
