// Package doccheck finds two kinds of stale documentation in kvrelay's tracked files:
// citations of design documents the repository does not contain, and package doc comments
// in the future tense. hack/verify-docs runs it over `git ls-files` for `make verify`.
//
// A citation is
//   - a top-level design document's name (ARCHITECTURE or DESIGN, with the .md suffix, in
//     any case, with or without a path before it), anywhere in a file;
//   - a path into docs/ ending in .md (docs/routing-cost.md, or with ./ or ../ before it),
//     anywhere in a file, unless it is the tail of a longer path or URL or follows a
//     possessive (SGLang's docs/... names another project's file);
//   - in a Markdown file, a relative link to a .md file ("[x](block-hashing.md)").
//
// A citation holds when the file it names is tracked: relative to the citing file's folder,
// or (names without ./ or ../) to the repository's root. A package doc comment is in the
// future tense when it opens "// Package x will" (or "shall", "is going to"): a package's doc
// says what it holds today.
package doccheck

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
)

// Finding is one violation: the file, the line (1-based) and what is wrong.
type Finding struct {
	Path   string
	Line   int
	Reason string
}

func (f Finding) String() string { return fmt.Sprintf("%s:%d: %s", f.Path, f.Line, f.Reason) }

var (
	// designDoc matches a top-level design document's name, with any path before it.
	designDoc = regexp.MustCompile(`(?i)(?:^|[^A-Za-z0-9_.-])((?:[A-Za-z0-9_.-]+/)*(?:ARCHITECTURE|DESIGN)\.md)\b`)
	// docsPath matches a path into docs/ ending in .md that is not the tail of a longer path
	// or URL (the character before it is not part of a path).
	docsPath = regexp.MustCompile(`(?:^|[^A-Za-z0-9_./-])((?:\.{1,2}/)*docs/[A-Za-z0-9_./-]*?\.md)\b`)
	// mdLink matches a Markdown link's target.
	mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	// futurePackage matches a package doc comment that opens in the future tense.
	futurePackage = regexp.MustCompile(`^//\s*Package\s+[A-Za-z0-9_]+\s+(will|shall|is going to)\b`)
	// scheme starts a link that leaves the repository (https:, mailto:, ...).
	scheme = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)
)

// skip reports whether p's text is someone else's (vendored code, checksums) and not
// kvrelay's to fix.
func skip(p string) bool {
	return strings.HasSuffix(p, ".sum") || strings.HasPrefix(p, "third_party/")
}

// Check examines each of paths (relative to root, as `git ls-files` prints them, slash
// separated) and returns every violation found. The paths are also the set of files a
// citation may name. An error is returned only when a file cannot be read.
func Check(root string, paths []string) ([]Finding, error) {
	tracked := make(map[string]bool, len(paths))
	for _, p := range paths {
		tracked[path.Clean(p)] = true
	}
	var out []Finding
	for _, p := range paths {
		if skip(p) {
			continue
		}
		b, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(p)))
		if err != nil {
			if os.IsNotExist(err) {
				continue // deleted in the work tree, not yet in the index
			}
			return nil, fmt.Errorf("checking %s: %w", p, err)
		}
		if bytes.IndexByte(b[:min(len(b), 8<<10)], 0) >= 0 {
			continue // binary data
		}
		out = append(out, checkFile(p, b, tracked)...)
	}
	return out, nil
}

// checkFile returns the findings in one file's text.
func checkFile(p string, text []byte, tracked map[string]bool) []Finding {
	var out []Finding
	dir := path.Dir(p)
	resolves := func(target string, fromRoot bool) bool {
		if tracked[path.Join(dir, target)] {
			return true
		}
		return fromRoot && tracked[path.Clean(target)]
	}
	isGo := strings.HasSuffix(p, ".go")
	isMarkdown := strings.HasSuffix(strings.ToLower(p), ".md")
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		for _, m := range designDoc.FindAllStringSubmatchIndex(line, -1) {
			name := line[m[2]:m[3]]
			if !resolves(name, !strings.HasPrefix(name, ".")) {
				out = append(out, Finding{p, n, "cites " + name + ", which the repository does not contain (design notes live under docs/)"})
			}
		}
		for _, m := range docsPath.FindAllStringSubmatchIndex(line, -1) {
			name := line[m[2]:m[3]]
			if possessive(line[:m[2]]) {
				continue
			}
			if !resolves(name, !strings.HasPrefix(name, ".")) {
				out = append(out, Finding{p, n, "cites " + name + ", which the repository does not contain"})
			}
		}
		if isMarkdown {
			for _, m := range mdLink.FindAllStringSubmatch(line, -1) {
				target, _, _ := strings.Cut(m[1], "#")
				if target == "" || scheme.MatchString(target) || strings.HasPrefix(target, "/") ||
					!strings.HasSuffix(strings.ToLower(target), ".md") {
					continue
				}
				if !resolves(target, false) {
					out = append(out, Finding{p, n, "links to " + target + ", which the repository does not contain"})
				}
			}
		}
		if isGo && futurePackage.MatchString(line) {
			out = append(out, Finding{p, n, "package doc in the future tense: say what the package holds today"})
		}
	}
	return out
}

// possessive reports whether before (the text ahead of a path) ends in a possessive, as in
// "SGLang's `docs/...`": the path is another project's.
func possessive(before string) bool {
	before = strings.TrimRight(before, " `\"'*_([")
	return strings.HasSuffix(before, "'s") || strings.HasSuffix(before, "’s")
}
