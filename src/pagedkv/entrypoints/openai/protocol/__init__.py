"""The bodies of the OpenAI API subset pagedkv serves, one kind of thing per module.

requests.py            the request models (completions, chat, /tokenize, /detokenize)
sampling_request.py    what completion and chat requests share, and the engine parameters
messages.py            chat messages and tools, and their form for the chat template
structured_outputs.py  the fields that constrain the output, and the one constraint they give
refusals.py            the known fields pagedkv refuses or ignores, and UnsupportedFieldError
schema.py              the strict base of the request models and their JSON Schema
fields.py              the types of request fields, and the bounds on one request
responses.py           the response models, and OpenAI's error body

Import names from the module that defines them (``protocol.requests.ChatCompletionRequest``):
this package re-exports nothing.
"""
