package tenant

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParseAndLookup(t *testing.T) {
	sum := sha256.Sum256([]byte("sk-hashed"))
	tab, err := Parse([]byte(`# keys
sk-alpha tenant=alpha,weight=2,rps=5,prompt_tps=1000,output_tpm=6000
sk-alpha-2 tenant=alpha

sha256:` + hex.EncodeToString(sum[:]) + ` tenant=beta
`))
	if err != nil {
		t.Fatal(err)
	}
	a := tab.Lookup([]byte("Bearer sk-alpha"))
	if a == nil || a.Name != "alpha" || a.Limits != (Limits{Weight: 2, RPS: 5, PromptTPS: 1000, OutputTPM: 6000}) {
		t.Fatalf("sk-alpha: %+v", a)
	}
	if tab.Lookup([]byte("bearer  sk-alpha-2 ")) != a {
		t.Error("a second key of a tenant is another tenant")
	}
	if b := tab.Lookup([]byte("Bearer sk-hashed")); b == nil || b.Name != "beta" || b.Limits.Weight != 1 {
		t.Errorf("a key given by its SHA-256: %+v", b)
	}
	for _, auth := range []string{"", "Bearer", "Bearer sk-nope", "Basic sk-alpha", "sk-alpha"} {
		if got := tab.Lookup([]byte(auth)); got != nil {
			t.Errorf("Authorization %q: tenant %s", auth, got.Name)
		}
	}
	var none *Table
	if none.Lookup([]byte("Bearer sk-alpha")) != nil {
		t.Error("a nil table knows a key")
	}
}

func TestParseRefuses(t *testing.T) {
	for _, bad := range []string{
		"sk-only-a-key",
		"sk tenant=",
		"sk rps=5",
		"sk tenant=a,rps=-1",
		"sk tenant=a,rps=many",
		"sk tenant=a,burst=3",
		"sha256:abcd tenant=a",
		"sk tenant=a\nsk tenant=b",
		"sk1 tenant=a,rps=1\nsk2 tenant=a,rps=2",
		"sk tenant=a b",
		"sk tenant=a,cache=",
		"sk tenant=a,cache=\"r\"",
		"sk tenant=a,cache=" + strings.Repeat("r", 129),
		"sk1 tenant=a,cache=r\nsk2 tenant=a,cache=s",
		"sk1 tenant=a,cache=r\nsk2 tenant=a",
		"sk1 tenant=a\nsk2 tenant=a,cache=r",
		"sk tenant=a\x00b",
		"sk tenant=a,cache=r\x1b",
	} {
		if _, err := Parse([]byte(bad)); !errors.Is(err, ErrSyntax) {
			t.Errorf("%q: %v, want ErrSyntax", bad, err)
		}
	}
	_, err := Parse([]byte("sk1 tenant=a,cache=public\n# a comment\nsk2 tenant=a"))
	if err == nil || !strings.Contains(err.Error(), "line 3: tenant a has no cache region here but cache region public on line 1") {
		t.Errorf("keys of one tenant in two regions: %v", err)
	}
}

// TestCacheRegion: tenants naming one cache region get one salt, a client's own salt kept
// apart within it; a tenant of another region, or of none, gets another, a private tenant the
// salt it had before regions; a region named like a tenant does not get that tenant's salt.
// Budgets stay each tenant's; a reload that moves a tenant to another region moves its salt.
func TestCacheRegion(t *testing.T) {
	tab, err := Parse([]byte(`sk-a tenant=a,rps=5,cache=public
sk-a2 tenant=a,cache=public
sk-c tenant=c,weight=3,cache=public
sk-b tenant=b
sk-d tenant=d,cache=other
sk-e tenant=e,cache=b
`))
	if err != nil {
		t.Fatal(err)
	}
	ten := func(key string) *Tenant {
		t.Helper()
		ten := tab.Lookup([]byte("Bearer " + key))
		if ten == nil {
			t.Fatalf("%s: no tenant", key)
		}
		return ten
	}
	salt := func(key, client string) string { return string(ten(key).Salt([]byte(client))) }
	a := salt("sk-a", "")
	if c := salt("sk-c", ""); c != a {
		t.Errorf("tenants a and c of region public: salts %s and %s", a, c)
	}
	if a2 := salt("sk-a2", ""); a2 != a {
		t.Errorf("two keys of tenant a: salts %s and %s", a, a2)
	}
	if x := salt("sk-a", "x"); x == a || x != salt("sk-c", "x") || x == salt("sk-a", "y") {
		t.Error("a client's own salt is not kept apart within the region, or not shared across it")
	}
	if b := salt("sk-b", ""); b == a {
		t.Error("tenant b, in no region, has region public's salt")
	}
	if d := salt("sk-d", ""); d == a {
		t.Error("regions other and public have one salt")
	}
	if e := salt("sk-e", ""); e == salt("sk-b", "") {
		t.Error("region b has tenant b's own salt")
	}
	// A private tenant's salt is what it was before regions: a new version does not empty
	// every engine's cache.
	sum := sha256.Sum256([]byte("kvrelay tenant\x00b\x00"))
	if b, want := salt("sk-b", ""), "kvrelay-"+hex.EncodeToString(sum[:16]); b != want {
		t.Errorf("tenant b's salt %s, want %s", b, want)
	}
	// Region and client salt do not run into each other.
	if string((&Tenant{Region: "ab"}).Salt([]byte("c"))) == string((&Tenant{Region: "a"}).Salt([]byte("bc"))) {
		t.Error("region ab with client salt c has region a's salt with bc")
	}
	ta, tc := ten("sk-a"), ten("sk-c")
	if ta == tc || ta.Region != "public" || ta.Limits.RPS != 5 || tc.Limits.RPS != 0 || tc.Limits.Weight != 3 || ten("sk-b").Region != "" {
		t.Errorf("tenants of one region: %+v and %+v", ta, tc)
	}
	now := time.Unix(1000, 0)
	for range 5 {
		if _, ex := ta.Admit(now, 0, 0); ex != nil {
			t.Fatal(ex)
		}
	}
	if _, ex := tc.Admit(now, 0, 0); ex != nil {
		t.Error("tenant c was refused once tenant a of its region spent its budget")
	}

	f := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(f, []byte("k tenant=a,cache=public\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := NewKeys(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(k.Lookup([]byte("Bearer k")).Salt(nil)); got != a {
		t.Fatalf("tenant a of region public: salt %s, want %s", got, a)
	}
	if err := os.WriteFile(f, []byte("k tenant=a,cache=private-a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(f)
	_ = os.Chtimes(f, fi.ModTime().Add(time.Second), fi.ModTime().Add(time.Second))
	if err := k.reload(); err != nil {
		t.Fatal(err)
	}
	if got := k.Lookup([]byte("Bearer k")); got.Region != "private-a" || string(got.Salt(nil)) == a {
		t.Errorf("tenant a moved to region private-a: region %q, salt %s (public's: %s)", got.Region, got.Salt(nil), a)
	}
}

// TestBudgets: requests per second, prompt tokens per second and generated tokens per
// minute are each reserved at admission; a request past one is refused with the wait until
// it refills; an answer's unused output goes back.
func TestBudgets(t *testing.T) {
	tab, err := Parse([]byte("k tenant=a,rps=2,prompt_tps=100,output_tpm=600\nfree tenant=free"))
	if err != nil {
		t.Fatal(err)
	}
	a := tab.Lookup([]byte("Bearer k"))
	now := time.Unix(1000, 0)
	r1, ex := a.Admit(now, 10, 100)
	if ex != nil {
		t.Fatal(ex)
	}
	if _, ex := a.Admit(now, 10, 100); ex != nil {
		t.Fatal(ex)
	}
	_, ex = a.Admit(now, 10, 100)
	if ex == nil || ex.Limit != "requests" || ex.RetryAfter <= 0 || ex.RetryAfter > 600*time.Millisecond {
		t.Fatalf("a third request in a second at 2/s: %+v", ex)
	}
	// A second later: two requests more; a prompt of 200 tokens goes (the bucket was above
	// zero) and leaves it in debt for 2 s.
	now = now.Add(time.Second)
	if _, ex := a.Admit(now, 200, 0); ex != nil {
		t.Fatal(ex)
	}
	if _, ex := a.Admit(now, 1, 0); ex == nil || ex.Limit != "prompt_tokens" {
		t.Fatalf("past the prompt budget: %+v", ex)
	}
	st := a.Status(now)
	if !st.Requests.Limited || !st.Tokens.Limited || st.Requests.Limit != 2 || st.Tokens.Limit != 100 || st.Tokens.Remaining != 0 || st.Tokens.Reset < 2*time.Second {
		t.Errorf("status %+v", st)
	}
	h := string(st.AppendHeaders(nil))
	for _, want := range []string{"x-ratelimit-limit-requests: 2\r\n", "x-ratelimit-remaining-tokens: 0\r\n", "x-ratelimit-reset-tokens: "} {
		if !strings.Contains(h, want) {
			t.Errorf("headers %q lack %q", h, want)
		}
	}
	// Output: 600 a minute, 200 reserved; the first answer used 20 of its 100.
	r1.Settle(20)
	a.mu.Lock()
	level := a.output.level
	a.mu.Unlock()
	if want := 600.0 - 200 + 80 + 10; level < want-1 || level > want+1 {
		t.Errorf("output budget %v after settling, want about %v", level, want)
	}
	Reservation{}.Settle(5) // no tenant: nothing
	free := tab.Lookup([]byte("Bearer free"))
	for range 1000 {
		if _, ex := free.Admit(now, 1e6, 1e6); ex != nil {
			t.Fatal("a tenant without limits was refused")
		}
	}
	if st := free.Status(now); st.Requests.Limited || st.Tokens.Limited || len(st.AppendHeaders(nil)) != 0 {
		t.Errorf("a tenant without limits has headers: %+v", st)
	}
}

// TestKeysReload: a changed file is read again, a tenant whose limits stay keeps its
// budgets' state, and a file that turns malformed leaves the keys in force.
func TestKeysReload(t *testing.T) {
	f := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(f, []byte("k1 tenant=a,rps=1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := NewKeys(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := k.Lookup([]byte("Bearer k1"))
	now := time.Now()
	if _, ex := a.Admit(now, 0, 0); ex != nil {
		t.Fatal(ex)
	}
	write := func(s string) {
		if err := os.WriteFile(f, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		fi, _ := os.Stat(f)
		// A later modification time, as a real edit a moment later would have.
		_ = os.Chtimes(f, fi.ModTime().Add(time.Second), fi.ModTime().Add(time.Second))
	}
	write("k1 tenant=a,rps=1\nk2 tenant=b\n")
	if err := k.reload(); err != nil {
		t.Fatal(err)
	}
	if k.Lookup([]byte("Bearer k2")) == nil {
		t.Fatal("a key added to the file is not known")
	}
	if got := k.Lookup([]byte("Bearer k1")); got != a {
		t.Fatal("a tenant with the same limits lost its budgets on reload")
	}
	if _, ex := a.Admit(now, 0, 0); ex == nil {
		t.Error("the reload refilled a spent budget")
	}
	write("k1 tenant=a,rps=oops\n")
	if err := k.reload(); !errors.Is(err, ErrSyntax) {
		t.Fatalf("a malformed file: %v", err)
	}
	if k.Lookup([]byte("Bearer k2")) == nil {
		t.Fatal("a malformed file dropped the keys in force")
	}
	if _, err := NewKeys(filepath.Join(t.TempDir(), "none"), nil); err == nil {
		t.Error("a missing file: no error")
	}
}

// TestKeysFromMountedSecret: a keys file the kubelet mounts from a Secret is a symlink into a
// directory it replaces whole on an update (<mount>/keys → ..data/keys, ..data →
// ..<timestamp>, swapped by a rename). A new version whose file has the old one's size and
// modification time is read all the same, once Watch looks again: its new key works and the
// key it revoked is refused.
func TestKeysFromMountedSecret(t *testing.T) {
	mount := t.TempDir()
	mtime := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	// version writes a Secret's version as the kubelet does: a timestamped directory holding
	// the key, ..data pointed at it by an atomic rename, the previous directory removed.
	version := func(name, keys string) {
		dir := filepath.Join(mount, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		f := filepath.Join(dir, "keys")
		if err := os.WriteFile(f, []byte(keys), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(f, mtime, mtime); err != nil {
			t.Fatal(err)
		}
		old, _ := os.Readlink(filepath.Join(mount, "..data"))
		if err := os.Symlink(name, filepath.Join(mount, "..data_tmp")); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(mount, "..data_tmp"), filepath.Join(mount, "..data")); err != nil {
			t.Fatal(err)
		}
		if old != "" {
			if err := os.RemoveAll(filepath.Join(mount, old)); err != nil {
				t.Fatal(err)
			}
		}
	}
	version("..2026_01_02_03_04_05.000000001", "sk-first tenant=a\n")
	if err := os.Symlink(filepath.Join("..data", "keys"), filepath.Join(mount, "keys")); err != nil {
		t.Fatal(err)
	}
	k, err := NewKeys(filepath.Join(mount, "keys"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if k.Lookup([]byte("Bearer sk-first")) == nil {
		t.Fatal("the mounted key is not known")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	const interval = 10 * time.Millisecond
	go func() { defer close(done); k.Watch(ctx, interval) }()

	// The update: another key in place of the first, of the same length, at the same time.
	version("..2026_01_02_03_04_05.000000002", "sk-other tenant=a\n")
	fi, err := os.Stat(filepath.Join(mount, "keys"))
	if err != nil || fi.Size() != int64(len("sk-first tenant=a\n")) || !fi.ModTime().Equal(mtime) {
		t.Fatalf("the new version's file: %v %v; want the old one's size and time", fi, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for k.Lookup([]byte("Bearer sk-other")) == nil {
		if time.Now().After(deadline) {
			t.Fatal("the Secret's new version was not read")
		}
		time.Sleep(interval)
	}
	if k.Lookup([]byte("Bearer sk-first")) != nil {
		t.Fatal("the key the new version revoked is still known")
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte("sk tenant=a,weight=2,rps=5,prompt_tps=1000,output_tpm=6000\n# c\n\nsha256:" + strings.Repeat("ab", 32) + " tenant=b"))
	f.Add([]byte("sk tenant=a,rps=1e308"))
	f.Add([]byte("x tenant=\"a\""))
	f.Add([]byte("sk1 tenant=a,cache=public\nsk2 tenant=b,rps=1,cache=public\nsk3 tenant=c\nsk4 tenant=d,cache=c\nsk5 tenant=a,cache=public"))
	f.Add([]byte("sk1 tenant=a,cache=r\nsk2 tenant=a"))
	f.Add([]byte("sk tenant=a,cache=r,cache=s"))
	f.Fuzz(func(t *testing.T, data []byte) {
		tab, err := Parse(data)
		if err != nil {
			if !errors.Is(err, ErrSyntax) {
				t.Fatalf("error %v does not wrap ErrSyntax", err)
			}
			return
		}
		salts, regions := map[string]*Tenant{}, map[string]string{}
		for name, ten := range tab.Tenants() {
			if ten.Name != name || ten.Limits.Weight <= 0 || len(ten.Region) > 128 || strings.ContainsAny(ten.Region, " \t\"") {
				t.Fatalf("tenant %q: %+v", name, ten)
			}
			// One salt for the tenants of a region, another for each tenant of none.
			s := string(ten.Salt(nil))
			if other, ok := salts[s]; ok && (ten.Region == "" || other.Region != ten.Region) {
				t.Fatalf("tenants %q (region %q) and %q (region %q) share salt %s", other.Name, other.Region, name, ten.Region, s)
			}
			salts[s] = ten
			if r, ok := regions[ten.Region]; ok && ten.Region != "" && r != s {
				t.Fatalf("region %q: salts %s and %s", ten.Region, r, s)
			}
			regions[ten.Region] = s
			if _, ex := ten.Admit(time.Unix(1, 0), 10, 10); ex != nil && ex.RetryAfter <= 0 {
				t.Fatalf("refused with no wait: %+v", ex)
			}
		}
	})
}

// A share of the fleet's budget scales the buckets: a proxy given a quarter of 8 requests/s
// admits 2 a second, its level kept as the same fraction of the bucket; what it was asked,
// admitted or refused, comes out as a smoothed rate.
func TestShareAndDemand(t *testing.T) {
	tab, err := Parse([]byte("sk-a tenant=a,rps=8\nsk-b tenant=b\n"))
	if err != nil {
		t.Fatal(err)
	}
	a := tab.Lookup([]byte("Bearer sk-a"))
	if !a.Limited() || tab.Lookup([]byte("Bearer sk-b")).Limited() {
		t.Fatal("Limited: a has a budget, b none")
	}
	now := time.Unix(100, 0)
	a.Demand(now) // starts the clock
	a.SetShare(0.25, 1, 1, now)
	if got := a.Shares(); got != [3]float64{0.25, 1, 1} {
		t.Fatalf("shares %v", got)
	}
	admitted := 0
	for i := range 40 { // 40 asked over 4 s
		if _, ex := a.Admit(now.Add(time.Duration(i)*100*time.Millisecond), 0, 0); ex == nil {
			admitted++
		}
	}
	// The bucket of 2 starts full: 2 at once, then 2 a second for the remaining 3.9 s.
	if admitted < 8 || admitted > 10 {
		t.Fatalf("admitted %d of 40 over 4 s on a quarter of 8/s", admitted)
	}
	d := a.Demand(now.Add(4 * time.Second))
	if d.Admitted != uint64(admitted) || d.Refused != uint64(40-admitted) {
		t.Fatalf("demand %+v, want %d admitted, %d refused", d, admitted, 40-admitted)
	}
	if d.Requests < 4.9 || d.Requests > 5.1 { // half of 10/s, smoothed with the first call's 0
		t.Fatalf("demand %v requests/s after 10/s for 4 s, want 5 (smoothed)", d.Requests)
	}
	// Shares out of bounds are clamped; NaN changes nothing.
	a.SetShare(0, 7, math.NaN(), now)
	if got := a.Shares(); got[0] != minShare || got[1] != 1 || got[2] != 1 {
		t.Fatalf("shares %v after SetShare(0, 7, NaN)", got)
	}
}

// Keys from a control plane count beside the file's; keys that contradict the file are
// refused and those in force stay; without a file, keys are checked only while the control
// plane gives some.
func TestRemoteKeys(t *testing.T) {
	file := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(file, []byte("sk-file tenant=files,rps=5"), 0o600); err != nil { // no final newline
		t.Fatal(err)
	}
	k, err := NewKeys(file, nil)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte("sk-op"))
	op := "sha256:" + hex.EncodeToString(sum[:]) + " tenant=acme\n"
	if err := k.SetRemote(op); err != nil || !k.Active() {
		t.Fatalf("SetRemote: %v, active %v", err, k.Active())
	}
	if k.Lookup([]byte("Bearer sk-op")) == nil || k.Lookup([]byte("Bearer sk-file")) == nil {
		t.Fatal("a key of the file or of the control plane not found")
	}
	files := k.Lookup([]byte("Bearer sk-file"))
	for _, bad := range []string{"sk-x tenant=files,rps=6\n", "nonsense\n", "sk-file tenant=other\n"} {
		if err := k.CheckRemote(bad); err == nil {
			t.Errorf("CheckRemote(%q): nil, want a refusal", bad)
		}
		if err := k.SetRemote(bad); err == nil || !strings.Contains(err.Error(), "control plane") {
			t.Errorf("SetRemote(%q): %v, want a refusal naming the control plane's keys", bad, err)
		}
	}
	if k.Lookup([]byte("Bearer sk-op")) == nil || k.Lookup([]byte("Bearer sk-file")) != files {
		t.Fatal("refused keys changed the keys in force")
	}
	if err := k.SetRemote(""); err != nil || k.Lookup([]byte("Bearer sk-op")) != nil || !k.Active() {
		t.Fatalf("keys taken away: %v, active %v", err, k.Active())
	}

	none, err := NewKeys("", nil)
	if err != nil || none.Active() {
		t.Fatalf("no file: %v, active %v", err, none.Active())
	}
	if err := none.SetRemote(op); err != nil || !none.Active() || none.Lookup([]byte("Bearer sk-op")) == nil {
		t.Fatalf("no file, keys from the control plane: %v, active %v", err, none.Active())
	}
	if err := none.SetRemote(""); err != nil || none.Active() {
		t.Fatalf("no file, the control plane's keys gone: %v, active %v", err, none.Active())
	}
}

// FuzzRemoteKeys: any text a control plane gives is taken or refused whole, without a panic.
func FuzzRemoteKeys(f *testing.F) {
	f.Add("sk tenant=a,rps=1\n")
	f.Add("sha256:" + strings.Repeat("ab", 32) + " tenant=b,cache=r\n# c\n")
	f.Add("sk-file tenant=x\n")
	f.Add("\x00 tenant=\xff")
	f.Fuzz(func(t *testing.T, remote string) {
		file := filepath.Join(t.TempDir(), "keys")
		if err := os.WriteFile(file, []byte("sk-file tenant=files,rps=5\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		k, err := NewKeys(file, nil)
		if err != nil {
			t.Fatal(err)
		}
		before := k.Table()
		if err := k.SetRemote(remote); err != nil {
			if k.Table() != before {
				t.Fatal("a refused text changed the keys in force")
			}
			return
		}
		if k.Lookup([]byte("Bearer sk-file")) == nil {
			t.Fatal("the file's key lost")
		}
	})
}

// FuzzLookup: any Authorization value finds a tenant only when it is "Bearer" (any case)
// and a listed key, spaces around them aside; it never panics.
func FuzzLookup(f *testing.F) {
	tab, err := Parse([]byte("sk-alpha tenant=alpha\nsk-beta tenant=beta\n"))
	if err != nil {
		f.Fatal(err)
	}
	for _, s := range []string{"Bearer sk-alpha", "bearer  sk-beta ", "Basic sk-alpha", "Bearer", "", "Bearer sk-alpha\x00", "\tBEARER sk-beta"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, auth []byte) {
		got := tab.Lookup(auth)
		if got == nil {
			return
		}
		scheme, tok, ok := strings.Cut(strings.TrimSpace(string(auth)), " ")
		key := strings.TrimSpace(tok)
		if !ok || !strings.EqualFold(scheme, "Bearer") || (key != "sk-alpha" && key != "sk-beta") || got.Name != strings.TrimPrefix(key, "sk-") {
			t.Fatalf("Authorization %q found tenant %s", auth, got.Name)
		}
	})
}
