// Command gencrd writes the chart's kvrelay.io CustomResourceDefinitions from a template and
// the Go types the control plane stores in them: the routing policy (registry.Policy, with its
// profile and candidate), a policy change (registry.PolicyChange), a worker (registry.Worker)
// and an API key (registry.APIKey). Their OpenAPI schemas are typed field by field, so that the API server
// refuses a misspelt field (kubectl's strict field validation) instead of keeping it for the
// control plane to read as zero, and `kubectl explain` describes each field with its Go doc.
//
//	go generate ./hack/gencrd
package main

//go:generate go run . -out ../deploy/helm/kvrelay/crds/kvrelay.io.yaml

import (
	"bytes"
	_ "embed"
	"flag"
	"fmt"
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"strings"
	"text/template"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/xds/policy"
)

//go:embed kvrelay.io.yaml.tmpl
var crdTemplate string

// roots are the types a template's {{schema}} names.
var roots = map[string]reflect.Type{
	"policy": reflect.TypeFor[registry.Policy](),
	"change": reflect.TypeFor[registry.PolicyChange](),
	"worker": reflect.TypeFor[registry.Worker](),
	"apikey": reflect.TypeFor[registry.APIKey](),
}

func main() {
	out := flag.String("out", "", "file to write (default: stdout)")
	flag.Parse()
	docs, err := fieldDocs(reflect.TypeFor[registry.Policy]().PkgPath(), reflect.TypeFor[policy.Profile]().PkgPath())
	if err != nil {
		fmt.Fprintln(os.Stderr, "gencrd:", err)
		os.Exit(1)
	}
	g := &gen{docs: docs}
	t := template.Must(template.New("crd").Funcs(template.FuncMap{"schema": g.schemaAt}).Parse(crdTemplate))
	var b bytes.Buffer
	if err := t.Execute(&b, nil); err != nil {
		fmt.Fprintln(os.Stderr, "gencrd:", err)
		os.Exit(1)
	}
	if *out == "" {
		os.Stdout.Write(b.Bytes())
		return
	}
	if err := os.WriteFile(*out, b.Bytes(), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "gencrd:", err)
		os.Exit(1)
	}
}

// gen renders schemas.
type gen struct {
	docs map[string]string // "pkg.Type.Field" → the field's doc, first sentence
}

// schemaAt renders root's schema as YAML lines indented by indent spaces, with description.
func (g *gen) schemaAt(root string, indent int, description string) (string, error) {
	t, ok := roots[root]
	if !ok {
		return "", fmt.Errorf("no type %q", root)
	}
	var b strings.Builder
	g.write(&b, t, indent, description, nil)
	return strings.TrimRight(b.String(), "\n"), nil
}

var durationType = reflect.TypeFor[time.Duration]()
var timeType = reflect.TypeFor[time.Time]()

// write writes t's schema at indent. seen holds the struct types being written above it: a
// type met again below itself (a policy's candidate) is written once more without the field
// that led back to it, so the schema stays finite as structural schemas must be.
func (g *gen) write(b *strings.Builder, t reflect.Type, indent int, description string, seen []reflect.Type) {
	pad := strings.Repeat(" ", indent)
	line := func(format string, args ...any) { fmt.Fprintf(b, pad+format+"\n", args...) }
	nullable := false
	for t.Kind() == reflect.Pointer {
		t, nullable = t.Elem(), true
	}
	switch {
	case t == durationType:
		line("type: integer")
		line("format: int64")
		description = strings.TrimSpace(description + " In nanoseconds.")
	case t == timeType:
		line("type: string")
		line("format: date-time")
	default:
		switch t.Kind() {
		case reflect.String:
			line("type: string")
		case reflect.Bool:
			line("type: boolean")
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			line("type: integer")
			line("format: int64")
		case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			line("type: integer")
			line("format: int64")
			line("minimum: 0")
		case reflect.Float32, reflect.Float64:
			line("type: number")
		case reflect.Slice:
			line("type: array")
			nullable = true
			line("items:")
			g.write(b, t.Elem(), indent+2, "", seen)
		case reflect.Map:
			line("type: object")
			nullable = true
			line("additionalProperties:")
			g.write(b, t.Elem(), indent+2, "", seen)
		case reflect.Struct:
			line("type: object")
			g.properties(b, t, indent, seen)
		default:
			panic(fmt.Sprintf("gencrd: no schema for %s", t))
		}
	}
	if nullable {
		line("nullable: true")
	}
	if description != "" {
		line("description: %s", quote(description))
	}
}

// properties writes the fields of struct t that JSON carries: of those whose type is
// being written above t, none (t itself not counted: a policy's candidate is written, the
// candidate's own candidate is not).
func (g *gen) properties(b *strings.Builder, t reflect.Type, indent int, seen []reflect.Type) {
	pad := strings.Repeat(" ", indent)
	type field struct {
		name string
		f    reflect.StructField
	}
	var fs []field
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if !f.IsExported() || name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && contains(seen, ft) {
			continue // the candidate of a candidate: none
		}
		fs = append(fs, field{name, f})
	}
	sort.Slice(fs, func(i, j int) bool { return fs[i].name < fs[j].name })
	seen = append(seen[:len(seen):len(seen)], t)
	fmt.Fprintf(b, "%sproperties:\n", pad)
	for _, f := range fs {
		fmt.Fprintf(b, "%s  %s:\n", pad, f.name)
		g.write(b, f.f.Type, indent+4, g.docs[t.PkgPath()+"."+t.Name()+"."+f.f.Name], seen)
	}
}

func contains(ts []reflect.Type, t reflect.Type) bool {
	for _, x := range ts {
		if x == t {
			return true
		}
	}
	return false
}

// quote is s as a YAML double-quoted scalar.
func quote(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", " ")
	return `"` + r.Replace(s) + `"`
}

// fieldDocs reads the doc comments of the struct fields of the packages at paths (import
// paths of this module), keyed "path.Type.Field": the comment's first sentence, or for a
// comment shared by a group of fields the sentence, as it stands.
func fieldDocs(paths ...string) (map[string]string, error) {
	_, self, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(self), "..", "..")
	const module = "github.com/kvrelay/kvrelay/"
	out := map[string]string{}
	for _, p := range paths {
		dir := filepath.Join(root, strings.TrimPrefix(p, module))
		fset := token.NewFileSet()
		pkgs, err := parser.ParseDir(fset, dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		for _, pkg := range pkgs {
			for _, f := range pkg.Files {
				ast.Inspect(f, func(n ast.Node) bool {
					ts, ok := n.(*ast.TypeSpec)
					if !ok {
						return true
					}
					st, ok := ts.Type.(*ast.StructType)
					if !ok {
						return true
					}
					for _, fl := range st.Fields.List {
						text := fl.Doc.Text()
						if text == "" {
							continue
						}
						var pr doc.Package
						sentence := pr.Synopsis(text)
						for _, name := range fl.Names {
							out[p+"."+ts.Name.Name+"."+name.Name] = sentence
						}
					}
					return true
				})
			}
		}
	}
	return out, nil
}
