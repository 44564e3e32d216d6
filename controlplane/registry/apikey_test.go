package registry

import (
	"errors"
	"math"
	"strings"
	"testing"
)

const sumA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
const sumB = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752"

func TestAPIKeys(t *testing.T) {
	good := APIKey{ID: "ci", SHA256: sumA, Tenant: "acme", Weight: 2, RPS: 5, Cache: "public"}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, k := range map[string]APIKey{
		"no id":        {SHA256: sumA, Tenant: "a"},
		"no tenant":    {ID: "k", SHA256: sumA},
		"short sum":    {ID: "k", SHA256: "abcd", Tenant: "a"},
		"not hex":      {ID: "k", SHA256: strings.Repeat("z", 64), Tenant: "a"},
		"space":        {ID: "k", SHA256: sumA, Tenant: "a b"},
		"comma":        {ID: "k", SHA256: sumA, Tenant: "a,rps=9"},
		"control":      {ID: "k", SHA256: sumA, Tenant: "a\x00"},
		"region quote": {ID: "k", SHA256: sumA, Tenant: "a", Cache: `"r"`},
		"negative":     {ID: "k", SHA256: sumA, Tenant: "a", RPS: -1},
		"NaN":          {ID: "k", SHA256: sumA, Tenant: "a", OutputTPM: math.NaN()},
		"Inf":          {ID: "k", SHA256: sumA, Tenant: "a", Weight: math.Inf(1)},
	} {
		if err := k.Validate(); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("%s: %v, want ErrInvalidKey", name, err)
		}
	}
	second := APIKey{ID: "laptop", SHA256: sumB, Tenant: "acme", Weight: 2, RPS: 5, Cache: "public"}
	if err := CheckAPIKeys([]APIKey{good, second}); err != nil {
		t.Fatal(err)
	}
	for name, keys := range map[string][]APIKey{
		"id twice":       {good, {ID: "ci", SHA256: sumB, Tenant: "x"}},
		"key twice":      {good, {ID: "other", SHA256: strings.ToUpper(sumA), Tenant: "x"}},
		"other limits":   {good, {ID: "laptop", SHA256: sumB, Tenant: "acme", Weight: 2, RPS: 6, Cache: "public"}},
		"another region": {good, {ID: "laptop", SHA256: sumB, Tenant: "acme", Weight: 2, RPS: 5}},
	} {
		if err := CheckAPIKeys(keys); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("%s: %v, want ErrInvalidKey", name, err)
		}
	}
	want := "sha256:" + sumA + " tenant=acme,weight=2,rps=5,cache=public\nsha256:" + sumB + " tenant=acme,weight=2,rps=5,cache=public\n"
	if got := KeysFile([]APIKey{second, good}); got != want {
		t.Fatalf("KeysFile:\n%s\nwant\n%s", got, want)
	}

	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	testBackendAPIKeys(t, s)
}

// testBackendAPIKeys: keys are listed by id whatever order they were put in, a put replaces
// the key of its id, a delete removes one key (and of an id never stored is no error).
func testBackendAPIKeys(t *testing.T, s Backend) {
	t.Helper()
	if got, err := s.APIKeys(); err != nil || len(got) != 0 {
		t.Fatalf("keys of a fresh store: %v, %v", got, err)
	}
	good := APIKey{ID: "ci", SHA256: sumA, Tenant: "acme", Weight: 2, RPS: 5, Cache: "public"}
	second := APIKey{ID: "laptop", SHA256: sumB, Tenant: "acme", Weight: 2, RPS: 5, Cache: "public"}
	for _, k := range []APIKey{second, good} {
		if err := s.PutAPIKey(k); err != nil {
			t.Fatal(err)
		}
	}
	got, err := s.APIKeys()
	if err != nil || len(got) != 2 || got[0] != good || got[1] != second {
		t.Fatalf("stored keys %v %v, want ci then laptop", got, err)
	}
	moved := APIKey{ID: "laptop", SHA256: sumB, Tenant: "dev", Weight: 0.5, RPS: 1.5, PromptTPS: 200, OutputTPM: 6000}
	if err := s.PutAPIKey(moved); err != nil {
		t.Fatal(err)
	}
	if got, err := s.APIKeys(); err != nil || len(got) != 2 || got[0] != good || got[1] != moved {
		t.Fatalf("after replacing laptop: %v %v, want ci and %v", got, err, moved)
	}
	if err := s.DeleteAPIKey("ci"); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.APIKeys(); len(got) != 1 || got[0] != moved {
		t.Fatalf("after deleting ci: %v", got)
	}
	if err := s.DeleteAPIKey("never-stored"); err != nil {
		t.Fatalf("deleting a key never stored: %v", err)
	}
}
