// Package treecheck finds what a maintainer would refuse to see tracked in kvrelay's
// repository: build outputs (executables, object files, archives), files over a size limit
// that are not listed as fixtures, and absolute paths of one machine's home or workspace.
// hack/verify-tree runs it over `git ls-files` for `make verify`.
package treecheck

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
)

// MaxSize is the largest file tracked without being listed as a fixture (4 MiB).
const MaxSize = 4 << 20

// Config says what Check allows. The zero value allows nothing beyond the defaults.
type Config struct {
	// Root is the directory the paths are relative to.
	Root string
	// LargeFixtures are paths (relative to Root) allowed to exceed MaxSize.
	LargeFixtures map[string]bool
	// MaxSize overrides the package's MaxSize when positive.
	MaxSize int64
}

// Finding is one violation: the file and what is wrong with it.
type Finding struct {
	Path   string
	Reason string
}

func (f Finding) String() string { return f.Path + ": " + f.Reason }

// machinePath matches an absolute path into one machine's home or workspace folders
// (a folder below /home/alice, /root, /work or /Users/alice). Paths below /tmp, /var, /usr,
// /etc or /sys describe a system, not a machine's owner, and are allowed.
var machinePath = regexp.MustCompile(`(^|[^A-Za-z0-9._~-])/(home|root|work|Users)/[A-Za-z0-9._+-]+/`)

// skipText are files whose text is someone else's (vendored code, checksums): machine paths
// in them are not kvrelay's to fix.
func skipText(p string) bool {
	return strings.HasSuffix(p, ".sum") || strings.HasPrefix(p, "third_party/")
}

// bpfObject reports whether p is bpf2go's generated probe object, the one kind of object
// file kvrelay commits (so that `go build` needs no clang).
func bpfObject(p string) bool {
	b := path.Base(p)
	return strings.HasSuffix(b, "_bpfel.o") || strings.HasSuffix(b, "_bpfeb.o")
}

// Check examines each of paths (relative to cfg.Root, as `git ls-files` prints them) and
// returns every violation found. An error is returned only when a file cannot be read.
func Check(cfg Config, paths []string) ([]Finding, error) {
	limit := cfg.MaxSize
	if limit <= 0 {
		limit = MaxSize
	}
	var out []Finding
	for _, p := range paths {
		full := filepath.Join(cfg.Root, filepath.FromSlash(p))
		st, err := os.Lstat(full)
		if err != nil {
			if os.IsNotExist(err) {
				continue // deleted in the work tree, not yet in the index
			}
			return nil, fmt.Errorf("checking %s: %w", p, err)
		}
		if !st.Mode().IsRegular() {
			continue
		}
		if st.Size() > limit && !cfg.LargeFixtures[p] {
			out = append(out, Finding{p, fmt.Sprintf("%d bytes, over the %d-byte limit and not listed as a fixture", st.Size(), limit)})
		}
		f, err := os.Open(full)
		if err != nil {
			return nil, fmt.Errorf("checking %s: %w", p, err)
		}
		kind, err := binaryKind(f)
		if err == nil && kind != "" && !bpfObject(p) {
			out = append(out, Finding{p, kind + " (a build output: ignore it, do not commit it)"})
		}
		if err == nil && kind == "" && !skipText(p) {
			if _, err = f.Seek(0, io.SeekStart); err == nil {
				var line int
				line, err = findMachinePath(f)
				if err == nil && line > 0 {
					out = append(out, Finding{p, fmt.Sprintf("line %d names an absolute path of one machine (home or workspace)", line)})
				}
			}
		}
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("checking %s: %w", p, err)
		}
	}
	return out, nil
}

// binaryKind names the kind of build output r starts with, or "" for anything else.
func binaryKind(r io.ReadSeeker) (string, error) {
	var head [64]byte
	n, err := io.ReadFull(r, head[:])
	if err != nil && err != io.ErrUnexpectedEOF && err != io.EOF {
		return "", err
	}
	h := head[:n]
	switch {
	case bytes.HasPrefix(h, []byte("\x7fELF")):
		if len(h) >= 18 {
			var t uint16
			if h[5] == 2 {
				t = binary.BigEndian.Uint16(h[16:])
			} else {
				t = binary.LittleEndian.Uint16(h[16:])
			}
			switch t {
			case 1:
				return "ELF object file", nil
			case 3:
				return "ELF shared object or PIE executable", nil
			}
		}
		return "ELF executable", nil
	case bytes.HasPrefix(h, []byte{0xfe, 0xed, 0xfa, 0xce}), bytes.HasPrefix(h, []byte{0xfe, 0xed, 0xfa, 0xcf}),
		bytes.HasPrefix(h, []byte{0xce, 0xfa, 0xed, 0xfe}), bytes.HasPrefix(h, []byte{0xcf, 0xfa, 0xed, 0xfe}):
		return "Mach-O binary", nil
	case bytes.HasPrefix(h, []byte("!<arch>\n")):
		return "ar archive (static library or Go package archive)", nil
	case bytes.HasPrefix(h, []byte("\x00asm")):
		return "WebAssembly module", nil
	case bytes.HasPrefix(h, []byte("MZ")) && len(h) >= 64:
		off := int64(binary.LittleEndian.Uint32(h[0x3c:]))
		var sig [4]byte
		if _, err := r.Seek(off, io.SeekStart); err == nil {
			if _, err := io.ReadFull(r, sig[:]); err == nil && string(sig[:]) == "PE\x00\x00" {
				return "Windows PE executable", nil
			}
		}
	}
	return "", nil
}

// findMachinePath returns the first line (1-based) of r that names a machine path, or 0.
// Files with NUL bytes in their first 8 KiB are taken for binary data and skipped.
func findMachinePath(r io.Reader) (int, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	if peek, _ := br.Peek(8 << 10); bytes.IndexByte(peek, 0) >= 0 {
		return 0, nil
	}
	sc := bufio.NewScanner(br)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for n := 1; sc.Scan(); n++ {
		if machinePath.Match(sc.Bytes()) {
			return n, nil
		}
	}
	return 0, sc.Err()
}

// ReadList reads a list of paths, one per line; blank lines and lines starting with # are
// skipped. A missing file is an empty list.
func ReadList(file string) (map[string]bool, error) {
	b, err := os.ReadFile(file)
	if os.IsNotExist(err) {
		return map[string]bool{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", file, err)
	}
	m := map[string]bool{}
	for _, l := range strings.Split(string(b), "\n") {
		l = strings.TrimSpace(l)
		if l != "" && !strings.HasPrefix(l, "#") {
			m[l] = true
		}
	}
	return m, nil
}
