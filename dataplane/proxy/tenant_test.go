package proxy_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// TestAPIKeys: with --api-keys-file, the OpenAI SDK gets 401 invalid_api_key without a
// listed key, its answers with one (and the tenant's budgets in OpenAI's x-ratelimit-*
// headers), and 429 rate_limit_exceeded with Retry-After once its tenant is past a budget;
// the engines never see the client's key; a key added to the file works without a restart.
func TestAPIKeys(t *testing.T) {
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	if err := os.WriteFile(keys, []byte("sk-free tenant=free\nsk-slow tenant=slow,rps=1,prompt_tps=100000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// One engine behind a relay that records whether a request carried an Authorization.
	w := startWorker(t, nil)
	var sawKey atomic.Int32
	target, _ := http.NewRequest("GET", w.URL(), nil)
	relay := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "" {
			sawKey.Add(1)
		}
		r.URL.Scheme, r.URL.Host, r.RequestURI = "http", target.URL.Host, ""
		resp, err := http.DefaultTransport.RoundTrip(r)
		if err != nil {
			rw.WriteHeader(502)
			return
		}
		defer resp.Body.Close()
		for k, v := range resp.Header {
			rw.Header()[k] = v
		}
		rw.WriteHeader(resp.StatusCode)
		buf := make([]byte, 32<<10)
		for {
			n, err := resp.Body.Read(buf)
			if n > 0 {
				_, _ = rw.Write(buf[:n])
				if f, ok := rw.(http.Flusher); ok {
					f.Flush()
				}
			}
			if err != nil {
				return
			}
		}
	}))
	t.Cleanup(relay.Close)
	p := startProxy(t, []string{relay.URL}, func(c *proxy.Config) { c.APIKeysFile = keys })
	base := "http://" + p.Addr() + "/v1"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	params := openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")},
		MaxTokens: openai.Int(4),
	}
	client := func(key string) *openai.Client {
		c := openai.NewClient(option.WithBaseURL(base), option.WithAPIKey(key), option.WithMaxRetries(0))
		return &c
	}

	var apiErr *openai.Error
	for _, key := range []string{"sk-nope", ""} {
		_, err := client(key).Chat.Completions.New(ctx, params)
		if !errors.As(err, &apiErr) || apiErr.StatusCode != 401 || apiErr.Code != "invalid_api_key" {
			t.Fatalf("key %q: %v, want 401 invalid_api_key", key, err)
		}
	}

	var resp *http.Response
	if _, err := client("sk-free").Chat.Completions.New(ctx, params, option.WithResponseInto(&resp)); err != nil {
		t.Fatalf("a listed key: %v", err)
	}
	if resp.Header.Get("x-ratelimit-limit-requests") != "" {
		t.Errorf("a tenant without limits gets rate limit headers: %v", resp.Header)
	}
	if _, err := client("sk-slow").Chat.Completions.New(ctx, params, option.WithResponseInto(&resp)); err != nil {
		t.Fatalf("the slow tenant's first request: %v", err)
	}
	if resp.Header.Get("x-ratelimit-limit-requests") != "1" || resp.Header.Get("x-ratelimit-remaining-requests") != "0" || resp.Header.Get("x-ratelimit-limit-tokens") != "100000" {
		t.Errorf("rate limit headers %v", resp.Header)
	}
	_, err := client("sk-slow").Chat.Completions.New(ctx, params, option.WithResponseInto(&resp))
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 429 || apiErr.Code != "rate_limit_exceeded" {
		t.Fatalf("past 1 request a second: %v, want 429 rate_limit_exceeded", err)
	}
	if ra, _ := strconv.Atoi(apiErr.Response.Header.Get("Retry-After")); ra < 1 {
		t.Errorf("429 without a Retry-After: %v", apiErr.Response.Header)
	}
	if sawKey.Load() != 0 {
		t.Errorf("the engine saw the client's key on %d requests", sawKey.Load())
	}

	// A key added to the file works within a few seconds, without a restart.
	if err := os.WriteFile(keys, []byte("sk-free tenant=free\nsk-slow tenant=slow,rps=1,prompt_tps=100000\nsk-new tenant=new\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(keys)
	_ = os.Chtimes(keys, fi.ModTime().Add(2*time.Second), fi.ModTime().Add(2*time.Second))
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := client("sk-new").Chat.Completions.New(ctx, params)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a key added to the file: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// The refusals and admissions are counted by tenant.
	mresp, err := http.Get("http://" + p.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer mresp.Body.Close()
	var b strings.Builder
	buf := make([]byte, 64<<10)
	for {
		n, err := mresp.Body.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			break
		}
	}
	// (sk-new was refused until the file was read again: two refusals or more.)
	for _, want := range []string{
		`kvrelay_proxy_tenant_refused_total{reason="invalid_api_key",tenant=""} `,
		`kvrelay_proxy_tenant_refused_total{reason="requests",tenant="slow"} 1`,
		`kvrelay_proxy_tenant_requests_total{tenant="slow"} 1`,
	} {
		if !strings.Contains(b.String(), want) {
			var have []string
			for _, l := range strings.Split(b.String(), "\n") {
				if strings.HasPrefix(l, "kvrelay_proxy_tenant_") {
					have = append(have, l)
				}
			}
			t.Errorf("metrics lack %s; have %q", want, have)
		}
	}
}

// TestTenantCacheSalt: the proxy gives each tenant's requests a cache_salt of its own, so a
// prompt one tenant sent is a cache hit for that tenant again and for no other; a client's
// own salt cannot reach another tenant's.
func TestTenantCacheSalt(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-a tenant=a\nsk-b tenant=b\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startCluster(t, 1, func(c *proxy.Config) { c.APIKeysFile = keys }, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cached := func(key, salt string) int64 {
		t.Helper()
		cl := openai.NewClient(option.WithBaseURL(c.base+"/v1"), option.WithAPIKey(key), option.WithMaxRetries(0))
		opts := []option.RequestOption{}
		if salt != "" {
			opts = append(opts, option.WithJSONSet("cache_salt", salt))
		}
		comp, err := cl.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:     model,
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(family(7)), openai.UserMessage("the same question")},
			MaxTokens: openai.Int(2),
		}, opts...)
		if err != nil {
			t.Fatal(err)
		}
		return comp.Usage.PromptTokensDetails.CachedTokens
	}
	if n := cached("sk-a", ""); n != 0 {
		t.Fatalf("tenant a's first request: %d cached tokens", n)
	}
	if n := cached("sk-a", ""); n == 0 {
		t.Fatal("tenant a's repeat: no cached tokens")
	}
	if n := cached("sk-b", ""); n != 0 {
		t.Fatalf("tenant b hit tenant a's cache: %d cached tokens", n)
	}
	// A client that sends the salt the engine saw for tenant a gets its own tenant's salt
	// around it, not a's cache.
	if n := cached("sk-b", "kvrelay-"+strings.Repeat("0", 32)); n != 0 {
		t.Fatalf("a client's salt reached another tenant's cache: %d cached tokens", n)
	}
}
