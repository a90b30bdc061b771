"""Text prompts for the default model (SmolLM2-135M-Instruct), shared by the tests that run
it through the engine on two paths and compare them (quantized and float weights, CUDA and
CPU, a 16-bit KV cache, tensor parallelism). Their token counts all differ."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "Counting: 1, 2, 3, 4, 5,",
    "Paged attention splits the key-value cache of a language model into fixed-size blocks so that",
    "Q: Why is the sky blue?\nA:",
    "Here is a short poem about the sea:\n",
]
