package sim

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The block manager (blockmgr*.go) is the one owner of the engine's KV block memory, as
// vLLM's KVCacheManager is: the pool's free queues and block table are package blockpool's
// own, and ownershipViolations keeps the rest of package sim from reaching past the block
// manager's API to the pool, the staging slots, the tiers or a block table.

// blockpoolPath is the import path of the GPU pool.
const blockpoolPath = "github.com/kvrelay/kvrelay/engines/sim/internal/blockpool"

// isBlockManagerFile reports whether a file of package sim belongs to the block manager.
func isBlockManagerFile(name string) bool { return strings.HasPrefix(filepath.Base(name), "blockmgr") }

// blockManagerAPI are the blockManager fields and methods the rest of the engine may use.
var blockManagerAPI = map[string]bool{
	// The scheduler's.
	"beginStep": true, "endStep": true, "lookup": true, "capLoad": true, "canAdmit": true, "fitting": true,
	"admit": true, "allocateSlots": true, "cacheBlocks": true, "free": true, "usage": true,
	"reset": true,
	// The KV connector's and the peer export's.
	"setClock": true, "gpuHits": true, "takeCached": true, "detach": true, "release": true,
	"exportPrefix": true,
	// Counters, not memory.
	"stats": true, "countHits": true,
}

// ownershipViolations lists where a file outside the block manager touches block memory:
// imports the pool, names the block manager's pool or staging slots, calls a blockManager
// method outside its API, or writes a block table (a .blocks field: assigned, copied or
// cleared into, its address taken, or set in a Request literal). Reading a block table is
// allowed: the KV connector names block ids.
func ownershipViolations(fset *token.FileSet, f *ast.File) []string {
	var out []string
	bad := func(n ast.Node, what string) {
		out = append(out, fset.Position(n.Pos()).String()+": "+what)
	}
	isBlocks := func(x ast.Expr) bool {
		for {
			switch y := x.(type) {
			case *ast.ParenExpr:
				x = y.X
			case *ast.IndexExpr:
				x = y.X
			case *ast.SliceExpr:
				x = y.X
			case *ast.StarExpr:
				x = y.X
			case *ast.SelectorExpr:
				return y.Sel.Name == "blocks"
			default:
				return false
			}
		}
	}
	isKVM := func(x ast.Expr) bool {
		switch y := x.(type) {
		case *ast.Ident:
			return y.Name == "kvm"
		case *ast.SelectorExpr:
			return y.Sel.Name == "kvm"
		}
		return false
	}
	for _, imp := range f.Imports {
		if strings.Trim(imp.Path.Value, `"`) == blockpoolPath {
			bad(imp, "imports the GPU pool")
		}
	}
	ast.Inspect(f, func(n ast.Node) bool {
		switch x := n.(type) {
		case *ast.SelectorExpr:
			switch {
			case x.Sel.Name == "pool" || x.Sel.Name == "staging":
				bad(x, "touches the block manager's "+x.Sel.Name)
			case isKVM(x.X) && !blockManagerAPI[x.Sel.Name]:
				bad(x, "uses blockManager."+x.Sel.Name+", not in its API")
			}
		case *ast.AssignStmt:
			for _, l := range x.Lhs {
				if isBlocks(l) {
					bad(l, "writes a block table")
				}
			}
		case *ast.IncDecStmt:
			if isBlocks(x.X) {
				bad(x, "writes a block table")
			}
		case *ast.UnaryExpr:
			if x.Op == token.AND && isBlocks(x.X) {
				bad(x, "takes a block table's address")
			}
		case *ast.CallExpr:
			if id, ok := x.Fun.(*ast.Ident); ok && (id.Name == "copy" || id.Name == "clear") && len(x.Args) > 0 && isBlocks(x.Args[0]) {
				bad(x, "writes a block table with "+id.Name)
			}
		case *ast.CompositeLit:
			if id, ok := x.Type.(*ast.Ident); ok && id.Name == "Request" {
				for _, e := range x.Elts {
					if kv, ok := e.(*ast.KeyValueExpr); ok {
						if k, ok := kv.Key.(*ast.Ident); ok && k.Name == "blocks" {
							bad(kv, "gives a request a block table")
						}
					}
				}
			}
		}
		return true
	})
	return out
}

// TestOwnershipCheck: the check finds each way of touching block memory outside the block
// manager, and lets the block manager and the API's callers be.
func TestOwnershipCheck(t *testing.T) {
	for _, tc := range []struct {
		name, file, src string
		want            int
	}{
		{"allocates from the pool", "scheduler.go", `func f(e *Engine) { e.kvm.pool.Allocate() }`, 1},
		{"frees through a pool alias", "peer.go", `func f(m *blockManager) { m.pool.Free(nil) }`, 1},
		{"takes a staging slot", "peer.go", `func f(e *Engine) { e.kvm.staging = e.kvm.staging[1:] }`, 2},
		{"calls past the API", "pd.go", `func f(e *Engine) { e.kvm.hit(1) }`, 1},
		{"empties a block table", "scheduler.go", `func f(r *Request) { r.blocks = r.blocks[:0] }`, 1},
		{"overwrites a block id", "scheduler.go", `func f(r *Request) { r.blocks[0]++ }`, 1},
		{"copies into a block table", "pd.go", `func f(r *Request, x []int32) { copy(r.blocks, x) }`, 1},
		{"takes a block table's address", "pd.go", `func f(r *Request) { g(&r.blocks) }`, 1},
		{"builds a request with blocks", "peer.go", `var r = &Request{ID: "x", blocks: []int32{1}}`, 1},
		{"imports the pool", "engine.go", `import _ "` + blockpoolPath + `"`, 1},
		{"asks the block manager", "scheduler.go", `func f(e *Engine, r *Request) { e.kvm.free(r); _ = len(r.blocks); g(r.blocks[0]); e.kvm.stats.peerTokens.Add(1) }`, 0},
		{"the block manager itself", "blockmgr.go", `func f(m *blockManager, r *Request) { r.blocks = append(r.blocks, m.pool.Take(1)); m.staging = nil }`, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fset := token.NewFileSet()
			f, err := parser.ParseFile(fset, tc.file, "package sim\n"+tc.src, 0)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			if !isBlockManagerFile(tc.file) {
				got = ownershipViolations(fset, f)
			}
			if len(got) != tc.want {
				t.Fatalf("%d findings, want %d: %q", len(got), tc.want, got)
			}
		})
	}
}

// TestBlockOwnership: no file of package sim but the block manager's touches block memory.
func TestBlockOwnership(t *testing.T) {
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	checked := 0
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") || isBlockManagerFile(name) {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, name, src, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range ownershipViolations(fset, f) {
			t.Errorf("%s: only the block manager (blockmgr*.go) owns block memory; ask it through its API", v)
		}
		checked++
	}
	if !slices.Contains(names, "scheduler.go") || checked < 10 {
		t.Fatalf("checked %d files of %v: not the package's", checked, names)
	}
}
