"""Tool calls: tools into the prompt, the model's calls out of its text, in its family's format.

One module per family's format, behind a registry (vLLM's tool parsers are laid out so):

    calls       Tool (a function a caller offers) and ToolCall (one call the model made)
    events      what reading a reply hands on: Reply (whole), or the stream's events
    hermes      Format, the base every family's derives from (Hermes' syntax), and
                CallStream, which reads calls between a start and an end marker
    llama3      Llama3, read whole (HeldStream)
    harmony     Harmony, gpt-oss's channels (HarmonyStream)
    qwen_xml    QwenXML, Qwen's XML calls (XMLCallStream)
    mistral     Mistral, its [TOOL_CALLS] calls, one by one or listed (MistralStream)
    think       ThinkStream: a think block (<think>...</think>) at a reply's start is
                Thought, before the family's own reader reads the rest
    registry    FORMATS by name; ``format_of``: the format a chat template points to (its
                THINKING twin where the template has a think-tag reasoning mode)


    Tool        a function a caller offers: name, description, JSON-schema parameters
    ToolCall    one call the model made: id, name, arguments (JSON text, as OpenAI sends it)
    Format      how a model family writes calls, picked from its chat template (``format_of``):
                  hermes  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one
                          block per call (Qwen 2.5/3, Hermes, SmolLM3; the default)
                  qwen_xml <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>
                          ...</function>\n</tool_call>, values as raw text (Qwen 3.5/3.6,
                          Qwen3-Coder)
                  llama3  {"name": ..., "parameters": {...}}, after <|python_tag|> or alone,
                          one call per reply (Llama 3.1 to 3.3)
                  mistral [TOOL_CALLS]NAME[ARGS]{...} per call (Mistral Small 3.2, Devstral);
                          mistral_list: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                          (Mistral Nemo); the markers are special tokens, kept like harmony's
                  harmony <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
                          {...}<|call|>, one call per generation (<|call|> ends it), among
                          messages on channels: analysis (reasoning), final (the answer),
                          commentary (gpt-oss). Every reply is read by it, with tools or
                          without, and its markers (special tokens) are kept in the decoded
                          text for it (``Format.markers``)

    prompt      the template gets ``tools`` as OpenAI's [{"type": "function", "function": ...}]
                and messages with ``tool_calls`` and role "tool"; a template that never reads
                them (the bundled ChatML one) gets the tools in a system message and the
                calls and results as text, in the format's own words (``Format.plain``)
    grammar     tool_choice "required" (Anthropic "any") or one named function: the output
                is held to calls of the allowed tools whose arguments validate against their
                schemas (``Format.grammar``, an llguidance Lark grammar with %json parts)
    parse       ``Format.parse(text)`` -> the text outside calls and the calls, for "auto"
                (the model may call or answer) and the constrained choices alike
    stream      ``Format.reader(tools)`` (the family's ``stream``, behind ThinkStream where
                the model thinks in tags) reads a reply as it is generated and hands on
                events: Said (text that can no longer be the start of a call), CallOpened (a
                call's name, as soon as it is written), Args (its arguments' JSON text as it
                comes), CallClosed (the call whole; its arguments are exactly the Args joined)
                and Thought (reasoning, never content: harmony's analysis channel, a think
                block).
                ``read`` (and ``parse``) is a stream fed the whole text, so a streamed reply
                and a whole one hold the same text and calls. A call cut off by the token
                limit is never CallClosed: a stream has sent its start, a whole reply leaves
                it out. Hermes, Qwen's XML, Mistral and harmony are read incrementally;
                Llama 3 (no start marker, and a reply is either a call or all text) is
                held to the end.
"""
