package auth

import (
	"strings"
	"testing"
)

// FuzzParseTokens: any tokens file parses or is refused without panicking, and what parses
// is a table with at least one entry; any token file parses only as one word.
func FuzzParseTokens(f *testing.F) {
	f.Add("proxy-a token-of-proxy-a-0123456789\n# comment\n\nproxy-b token-of-proxy-b-0123456789\n")
	f.Add("proxy-a short\n")
	f.Add("a b c\n")
	f.Add("x token-of-proxy-a-0123456789\ny token-of-proxy-a-0123456789\n")
	f.Fuzz(func(t *testing.T, file string) {
		if table, err := parseTokens([][]byte{[]byte(file)}); err == nil && len(table) == 0 {
			t.Fatal("an empty table parsed")
		}
		tok, err := parseToken([][]byte{[]byte(file)})
		if err == nil && (tok == "" || strings.ContainsAny(tok, " \t\r\n")) {
			t.Fatalf("token %q parsed", tok)
		}
	})
}
