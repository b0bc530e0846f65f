"""Small programs the lab tests run inside a namespace (`python -c SCRIPT args`)."""

# POST a prompt of random tokens to an instance: argv[1] = instance URL, argv[2] = blocks
# of 512 tokens. Prints the instance's answer (JSON).
RANDOM_PROMPT = (
    "import random, sys\n"
    "from catsproto.adapters.steering import post_json\n"
    "tokens = [random.randrange(128000) for _ in range(int(sys.argv[2]) * 512)]\n"
    "print(post_json(sys.argv[1] + '/generate', {'prompt_token_ids': tokens}, timeout=120))\n"
)
