package tokenizer

import (
	"strings"
	"testing"

	tiktoken "github.com/tiktoken-go/tokenizer"
)

// benchPrompt returns an English-and-code prompt of about n tokens under tok, built from the
// golden corpus so that the mix of words, code and whitespace is realistic.
func benchPrompt(tb testing.TB, tok Tokenizer, n int) string {
	tb.Helper()
	var parts []string
	for _, c := range loadCorpus(tb) {
		switch c.Name {
		case "english", "code", "markdown", "json", "contractions", "numbers", "url_and_email":
			parts = append(parts, c.Text)
		}
	}
	base := strings.Join(parts, "\n\n")
	var b strings.Builder
	for i := 0; tok.Count(b.String()) < n; i++ {
		// Vary the text so that a per-piece cache cannot hold the whole prompt.
		b.WriteString(base)
		b.WriteString("\n\nSection ")
		b.WriteString(strings.Repeat("x", i%7))
		b.WriteString("\n\n")
	}
	return b.String()
}

func BenchmarkEncode8k(b *testing.B) {
	for _, spec := range []string{O200kHarmony, O200kBase, Cl100kBase, qwen3TokenizerFile, llama3TokenizerFile, O200kHarmony + "/nocache"} {
		name := spec
		if i := strings.Index(name, "/"); i >= 0 && strings.HasPrefix(spec, "models/") {
			name = strings.Split(spec, "/")[1]
		}
		spec, nocache := strings.CutSuffix(spec, "/nocache")
		tok := mustTokenizer(b, spec)
		if nocache {
			// The same tokenizer without its piece cache: every multi-token piece runs BPE.
			c := *tok.(*bpeTokenizer)
			c.cache = nil
			tok = &c
		}
		text := benchPrompt(b, tok, 8192)
		b.Run(name, func(b *testing.B) {
			dst := make([]uint32, 0, 16384)
			var n int
			b.SetBytes(int64(len(text)))
			b.ReportAllocs()
			for b.Loop() {
				dst = tok.AppendEncode(dst[:0], text)
				n = len(dst)
			}
			b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
		})
	}
}

func BenchmarkCount8k(b *testing.B) {
	tok := mustTokenizer(b, O200kHarmony)
	text := benchPrompt(b, tok, 8192)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		tok.Count(text)
	}
}

// BenchmarkTiktokenGo8k measures github.com/tiktoken-go/tokenizer on the same prompt, the
// baseline this package's own BPE replaces.
func BenchmarkTiktokenGo8k(b *testing.B) {
	tok := mustTokenizer(b, O200kBase)
	text := benchPrompt(b, tok, 8192)
	c, err := tiktoken.Get(tiktoken.O200kBase)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := c.Encode(text); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEncodeChat(b *testing.B) {
	tok := mustTokenizer(b, O200kHarmony)
	long := benchPrompt(b, tok, 2048)
	msgs := []Message{
		{Role: "system", Content: "You are a helpful assistant. Answer briefly."},
		{Role: "user", Content: long},
		{Role: "assistant", Content: "Here is a summary of the document."},
		{Role: "user", Content: "Now list the three main points."},
	}
	opts := RenderOptions{AddGenerationPrompt: true, Date: "2025-08-05"}
	codecs := []struct {
		name string
		c    *Codec
	}{
		{name: "harmony", c: &Codec{Tokenizer: tok, Template: harmonyTemplate{}}},
		{name: "chatml_o200k", c: &Codec{Tokenizer: tok, Template: chatMLTemplate{}}},
	}
	if tmpl, err := NewTemplate("testdata/models/qwen3/tokenizer_config.json"); err == nil {
		codecs = append(codecs, struct {
			name string
			c    *Codec
		}{name: "jinja_qwen3_o200k", c: &Codec{Tokenizer: tok, Template: tmpl}})
	}
	for _, cc := range codecs {
		b.Run(cc.name, func(b *testing.B) {
			dst := make([]uint32, 0, 8192)
			b.ReportAllocs()
			var err error
			for b.Loop() {
				dst, err = cc.c.AppendEncodeChat(dst[:0], msgs, opts)
				if err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(dst)), "tokens/op")
		})
	}
}
