package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// chromium finds the browser for the console's tests: $KVRELAY_CHROMIUM, else Debian's
// chromium (hack/ci-deps.sh installs it). Without one the test skips, unless
// KVRELAY_BROWSER_REQUIRE is set (CI), when it fails.
func chromium(t *testing.T) string {
	t.Helper()
	for _, c := range []string{os.Getenv("KVRELAY_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"} {
		if c == "" {
			continue
		}
		if p, err := exec.LookPath(c); err == nil {
			return p
		}
	}
	msg := "no Chromium: the console's browser tests need one (hack/ci-deps.sh installs Debian's chromium, or set KVRELAY_CHROMIUM)"
	if os.Getenv("KVRELAY_BROWSER_REQUIRE") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// TestConsoleInBrowser loads the console of a running `kvrelay up --planner` in headless
// Chromium and checks what an operator would: every worker listed and up, a drained worker
// shown drained, decisions appearing within a second of requests and explained on a click,
// the planner's scale-up after a burst, a rollout's abort refused without the token and
// done with it; and at 1280 px and phone width, in both themes, that nothing overflows the
// window. Screenshots go to the test's temporary folder, or to $KVRELAY_SCREENSHOTS.
func TestConsoleInBrowser(t *testing.T) {
	if testing.Short() {
		t.Skip("starts worker processes and a browser")
	}
	browser := chromium(t)
	profile := burstProfile(t)
	// One tenant with a budget, so that the console lists it.
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-console tenant=acme,rps=1000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	pr, stop := startUp(t, "--expose-worker-header", "--api-keys-file", keys, "--workers", "2", "--speedup-ratio", "20", "--num-gpu-blocks", "4096",
		"--planner", "--planner-profile", profile, "--planner-max", "3",
		"--planner-interval", "2s", "--planner-load-interval", "500ms", "--planner-cooldown", "3s")
	defer stop(20 * time.Second)
	proxyRe := regexp.MustCompile(`^proxy +openai (\S+)/v1 `)
	apiRe := regexp.MustCompile(`^control .* api (http://\S+)  token (\S+)`)
	consoleRe := regexp.MustCompile(`^console +(http://\S+/ui/)`)
	var proxy, api, tokenPath, console string
	sc := bufio.NewScanner(pr)
	for (proxy == "" || api == "" || console == "") && sc.Scan() {
		if m := proxyRe.FindStringSubmatch(sc.Text()); m != nil {
			proxy = m[1]
		}
		if m := apiRe.FindStringSubmatch(sc.Text()); m != nil {
			api, tokenPath = m[1], m[2]
		}
		if m := consoleRe.FindStringSubmatch(sc.Text()); m != nil {
			console = m[1]
		}
	}
	if proxy == "" || api == "" || console == "" {
		t.Fatalf("up printed proxy %q, API %q, console %q", proxy, api, console)
	}
	go io.Copy(io.Discard, pr)
	tok, err := os.ReadFile(tokenPath)
	if err != nil {
		t.Fatal(err)
	}
	token := strings.TrimSpace(string(tok))
	apiCall := func(method, path, body string) (int, string) {
		req, _ := http.NewRequest(method, api+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	chat := func(i, words int) error {
		body := fmt.Sprintf(`{"model":"gpt-oss-120b","max_tokens":8,"messages":[{"role":"user","content":"request %d: %s"}]}`,
			i, strings.Repeat("tell me about rivers and stones ", words/6))
		req, _ := http.NewRequest(http.MethodPost, proxy+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer sk-console")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}

	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox,
		chromedp.Flag("headless", "new"), chromedp.WindowSize(1280, 900))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelAlloc()
	ctx, cancelTab := chromedp.NewContext(actx)
	defer cancelTab()
	ctx, cancelTimeout := context.WithTimeout(ctx, 3*time.Minute)
	defer cancelTimeout()
	run := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(ctx, steps...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	eval := func(expr string) (bool, error) { return chromedp.Run(ctx, chromedp.Evaluate[bool](expr)) }
	// waitJS polls a boolean expression in the page until it holds.
	waitJS := func(what, expr string, within time.Duration) time.Duration {
		t.Helper()
		t0 := time.Now()
		for {
			if ok, err := eval(expr); err == nil && ok {
				return time.Since(t0)
			}
			if time.Since(t0) > within {
				html, _ := chromedp.Run(ctx, chromedp.OuterHTML(chromedp.CSS("main")))
				t.Fatalf("%s: not within %s\n%.3000s", what, within, html)
			}
			time.Sleep(25 * time.Millisecond)
		}
	}

	run("loading the console", chromedp.Navigate(console))
	// Every worker, up.
	var workers struct {
		Workers []struct {
			Spec struct{ ID string } `json:"spec"`
		} `json:"workers"`
	}
	_, body := apiCall("GET", "/v1/workers", "")
	if err := json.Unmarshal([]byte(body), &workers); err != nil || len(workers.Workers) != 2 {
		t.Fatalf("workers: %s (%v)", body, err)
	}
	for _, w := range workers.Workers {
		waitJS("worker "+w.Spec.ID+" listed up", fmt.Sprintf(`!!document.querySelector('#workers tr[data-worker=%q][data-state="up"]')`, w.Spec.ID), 10*time.Second)
	}
	// A drained worker shows drained.
	drained := workers.Workers[1].Spec.ID
	if out, err := runCtlAt(t, api, "drain", drained, "--token-file", tokenPath); err != nil {
		t.Fatalf("kvrelay ctl drain %s: %v\n%s", drained, err, out)
	}
	waitJS("the drained worker shown drained", fmt.Sprintf(`!!document.querySelector('#workers tr[data-worker=%q][data-state="draining"]')`, drained), 5*time.Second)
	if code, b := apiCall("POST", "/v1/workers/"+drained+"/undrain", "{}"); code != 200 {
		t.Fatalf("undrain %s: %d %s", drained, code, b)
	}

	// Decisions appear within a second of the requests that made them.
	before, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('#decision-list tbody tr').length`))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 24 {
		if err := chat(1000+i, 60); err != nil {
			t.Fatal(err)
		}
	}
	took := waitJS("decisions appearing", fmt.Sprintf(`document.querySelectorAll('#decision-list tbody tr').length > %d`, before), time.Second)
	t.Logf("decisions appeared %s after the requests", took.Round(time.Millisecond))
	waitJS("the tenant listed with its requests", `(() => { const r = document.querySelector('#tenants tr[data-tenant="acme"]'); return !!r && Number(r.cells[5].textContent) >= 24; })()`, 5*time.Second)
	if dup, _ := eval(`(() => { const ids = [...document.querySelectorAll('#decision-list tbody tr')].map(r => r.dataset.decision); return new Set(ids).size !== ids.length; })()`); dup {
		t.Fatal("a decision is listed twice")
	}
	run("opening a decision", chromedp.Click(chromedp.CSS(`#decision-list tbody tr`)))
	waitJS("the decision explained", `!document.querySelector('#decision-detail').hidden && document.querySelectorAll('#detail-candidates tbody tr').length >= 1`, 5*time.Second)

	// A burst of long prompts: the planner scales up, and its table shows it.
	for i, deadline := 0, time.Now().Add(60*time.Second); time.Now().Before(deadline); i++ {
		var wg sync.WaitGroup
		for j := range 24 {
			wg.Add(1)
			go func(n int) { defer wg.Done(); _ = chat(n, 600) }(i*24 + j)
		}
		wg.Wait()
		if shown, _ := eval(`[...document.querySelectorAll('#planner-decisions tbody tr')].some(r => /2 → 3|1 → 2/.test(r.textContent))`); shown {
			break
		}
	}
	waitJS("the planner's scale-up shown", `[...document.querySelectorAll('#planner-decisions tbody tr')].some(r => /2 → 3|1 → 2/.test(r.textContent))`, 10*time.Second)
	waitJS("the replica chart reaching the scaled-up count", `(() => {
		const tos = [...document.querySelectorAll('#planner-decisions tbody tr')].map(r => /(\d+) → (\d+)/.exec(r.textContent)).filter(Boolean).map(m => Number(m[2]));
		return tos.length > 0 && Number(document.querySelector('#chart-replicas').dataset.max) >= Math.max(...tos);
	})()`, 10*time.Second)

	// A rollout: abort refused without the token, done with it.
	if code, b := apiCall("POST", "/v1/rollout", `{"candidate": {"policy": "round-robin"}, "spec": {"shadow_ms": 600000, "steps": [0.5, 1], "step_duration_ms": 600000}}`); code != 200 {
		t.Fatalf("starting a rollout: %d %s", code, b)
	}
	waitJS("the rollout shown", `document.querySelector('#rollout').dataset.state === 'shadow'`, 5*time.Second)
	run("abort without a token", chromedp.Click(chromedp.CSS(`#rollout button[data-action="abort"]`)))
	waitJS("the abort refused", `document.querySelector('#rollout-message').dataset.kind === 'error'`, 5*time.Second)
	if _, b := apiCall("GET", "/v1/rollout", ""); !strings.Contains(b, `"shadow"`) {
		t.Fatalf("the rollout changed without a token: %s", b)
	}
	// With the token, abort asks first: dismissed, nothing changes; accepted, it aborts.
	accept := make(chan bool, 2)
	accept <- false
	accept <- true
	asked := make(chan string, 2)
	if err := chromedp.Listen(ctx, func(ev any) {
		if d, ok := ev.(*page.EventJavascriptDialogOpening); ok {
			asked <- d.Message
			ok := <-accept
			go func() {
				_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: ok})
			}()
		}
	}); err != nil {
		t.Fatal(err)
	}
	run("entering the token", chromedp.SendKeys(chromedp.CSS(`#token`), token), chromedp.Click(chromedp.CSS(`#token-form button`)),
		chromedp.Click(chromedp.CSS(`#rollout button[data-action="abort"]`)))
	waitJS("the abort not confirmed", `document.querySelector('#rollout-message').dataset.kind === 'info'`, 5*time.Second)
	if q := <-asked; !strings.Contains(q, "Abort the rollout?") {
		t.Fatalf("the abort asked %q", q)
	}
	if _, b := apiCall("GET", "/v1/rollout", ""); !strings.Contains(b, `"shadow"`) {
		t.Fatalf("the rollout changed on a dismissed confirmation: %s", b)
	}
	run("confirming the abort", chromedp.Click(chromedp.CSS(`#rollout button[data-action="abort"]`)))
	waitJS("the abort done", `document.querySelector('#rollout-message').dataset.kind === 'ok'`, 5*time.Second)
	// The charts say how long they really cover.
	waitJS("the charts' window", `/Charts: the last \d+ s \(\d+ fleet updates/.test(document.querySelector('#charts-window').textContent)`, 5*time.Second)
	if _, b := apiCall("GET", "/v1/rollout", ""); !strings.Contains(b, `"aborted"`) {
		t.Fatalf("after the abort: %s", b)
	}

	// Nothing overflows at 1280 px and at a phone's width, in either theme.
	dir := t.TempDir()
	if d := os.Getenv("KVRELAY_SCREENSHOTS"); d != "" {
		dir = d // kept after the test
	}
	overflow := `(() => {
	  const w = document.documentElement.clientWidth;
	  if (document.documentElement.scrollWidth > w + 1) return 'page scrolls sideways: ' + document.documentElement.scrollWidth + ' > ' + w;
	  for (const e of document.querySelectorAll('body *')) {
	    if (e.closest('.scroll')) continue;
	    const r = e.getBoundingClientRect();
	    if (r.width === 0 && r.height === 0) continue;
	    if (r.left < -1 || r.right > w + 1) return (e.id || e.tagName) + ' ' + r.left.toFixed(0) + '..' + r.right.toFixed(0) + ' outside 0..' + w;
	    const box = e.closest('section, header, nav');
	    if (box && box !== e) {
	      const b = box.getBoundingClientRect();
	      if (r.right > b.right + 1 || r.left < b.left - 1) return (e.id || e.tagName) + ' ' + e.textContent.slice(0, 30) + ' sticks out of its ' + (box.id || box.tagName);
	    }
	  }
	  return '';
	})()`
	for _, size := range []struct {
		name string
		w, h int64
	}{{"desktop", 1280, 900}, {"phone", 390, 844}} {
		for _, theme := range []string{"light", "dark"} {
			run("sizing "+size.name, chromedp.EmulateViewport(size.w, size.h), chromedp.Sleep(300*time.Millisecond))
			if _, err := chromedp.Run(ctx, chromedp.Evaluate[string](fmt.Sprintf(`document.documentElement.dataset.theme = %q`, theme))); err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond)
			bad, err := chromedp.Run(ctx, chromedp.Evaluate[string](overflow))
			if err != nil {
				t.Fatal(err)
			}
			shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
			if err != nil {
				t.Fatal(err)
			}
			name := filepath.Join(dir, "console-"+size.name+"-"+theme+".png")
			if err := os.WriteFile(name, shot, 0o644); err != nil {
				t.Fatal(err)
			}
			if bad != "" {
				t.Fatalf("%s, %s theme: %s (screenshot %s)", size.name, theme, bad, name)
			}
		}
	}
	t.Logf("screenshots in %s", dir)
}
