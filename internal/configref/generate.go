package main

import (
	"bytes"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"reflect"
	"regexp"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/gpu-agent/gpu-agent/config"
)

// Doc comment lines that state what the code cannot say by itself: a
// default applied outside Parse (by the planner, the MPS package) and
// allowed values that are a range rather than constants. Each is one line of
// its own in a field's doc comment.
const (
	markDefault = "Default: "
	markValues  = "Values: "
)

// sources is what the generator reads from the config types' source.
type sources struct {
	fieldDocs map[string]string   // "Type.Field" → doc comment
	typeDocs  map[string]string   // "Type" → doc comment
	typed     map[string][]string // a named type → the values of its constants
	accepts   map[string][]string // "Type.Field" → constants whose group says "The values Type.Field accepts"
}

var reAccepts = regexp.MustCompile(`^The values (\w+\.\w+) accepts`)

// readSources parses the config types' file for doc comments and constants.
func readSources(path string) (*sources, error) {
	f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ParseComments)
	if err != nil {
		return nil, err
	}
	s := &sources{fieldDocs: map[string]string{}, typeDocs: map[string]string{}, typed: map[string][]string{}, accepts: map[string][]string{}}
	for _, decl := range f.Decls {
		gd, ok := decl.(*ast.GenDecl)
		if !ok {
			continue
		}
		switch gd.Tok {
		case token.TYPE:
			for _, spec := range gd.Specs {
				ts := spec.(*ast.TypeSpec)
				doc := ts.Doc
				if doc == nil && len(gd.Specs) == 1 {
					doc = gd.Doc
				}
				s.typeDocs[ts.Name.Name] = doc.Text()
				st, ok := ts.Type.(*ast.StructType)
				if !ok {
					continue
				}
				for _, fld := range st.Fields.List {
					text := fld.Doc.Text()
					if text == "" {
						text = fld.Comment.Text()
					}
					for _, n := range fld.Names {
						s.fieldDocs[ts.Name.Name+"."+n.Name] = text
					}
				}
			}
		case token.CONST:
			group := ""
			if m := reAccepts.FindStringSubmatch(gd.Doc.Text()); m != nil {
				group = m[1]
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i := range vs.Names {
					if i >= len(vs.Values) {
						continue
					}
					lit, ok := vs.Values[i].(*ast.BasicLit)
					if !ok || lit.Kind != token.STRING {
						continue
					}
					v, err := strconv.Unquote(lit.Value)
					if err != nil {
						return nil, err
					}
					if id, ok := vs.Type.(*ast.Ident); ok {
						s.typed[id.Name] = append(s.typed[id.Name], v)
					}
					if group != "" {
						s.accepts[group] = append(s.accepts[group], v)
					}
				}
			}
		}
	}
	return s, nil
}

// Probes are files that set the least a section needs, so that Parse fills
// in the defaults of every field under it. Two, since one device cannot be
// in both sharing policies.
var probes = []string{`version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources: [{name: nvidia.com/gpu, replicas: 2}]
    dra:
      migOnDemand: {}
`, `version: v1
configs:
  default:
    sharing:
      mps:
        resources: [{name: nvidia.com/gpu, replicas: 2}]
`}

// probe is one probe file as Parse defaults it and as written.
type probe struct{ defaulted, raw reflect.Value }

func loadProbes() ([]probe, error) {
	var out []probe
	for _, p := range probes {
		f, _, err := config.Parse([]byte(p))
		if err != nil {
			return nil, fmt.Errorf("probe config: %w", err)
		}
		var raw config.File
		if err := yaml.Unmarshal([]byte(p), &raw); err != nil {
			return nil, fmt.Errorf("probe config: %w", err)
		}
		out = append(out, probe{reflect.ValueOf(f).Elem(), reflect.ValueOf(&raw).Elem()})
	}
	return out, nil
}

// field is one entry of the reference.
type field struct {
	path     string // YAML path
	typ      string
	def      string // Markdown, "" for a mapping
	values   string // Markdown, "" when any value of the type goes
	doc      string // Markdown paragraphs
	mapping  bool   // a section of its own follows
	sameAs   string // the path of the entry that documents its fields, when already given
	sectionT string // the struct type a mapping holds
}

// generator walks config.File's type, reading docs and defaults on the way.
type generator struct {
	src     *sources
	probes  []probe
	fields  []field
	seen    map[reflect.Type]string // struct types documented, at which path
	errs    []error
	current string // the struct type whose fields are walked
}

// mapKey is how the reference writes a map's key, by YAML key.
var mapKey = map[string]string{
	"nodes":       "<node>",
	"configs":     "<config>",
	"mig-configs": "<entry>",
	"mig-devices": "<profile>",
}

var (
	durationType      = reflect.TypeFor[config.Duration]()
	quantityType      = reflect.TypeFor[config.Quantity]()
	stringListType    = reflect.TypeFor[config.StringList]()
	deviceIndicesType = reflect.TypeFor[config.DeviceIndices]()
	replicaDevsType   = reflect.TypeFor[config.ReplicaDevices]()
)

// generate writes the reference page from the types' source file.
func generate(srcPath string) ([]byte, error) {
	src, err := readSources(srcPath)
	if err != nil {
		return nil, err
	}
	ps, err := loadProbes()
	if err != nil {
		return nil, err
	}
	g := &generator{src: src, probes: ps, seen: map[reflect.Type]string{}}
	vals := make([]probe, len(ps))
	copy(vals, ps)
	g.walkStruct(reflect.TypeFor[config.File](), "", vals)
	if len(g.errs) > 0 {
		return nil, errors.Join(g.errs...)
	}
	return g.render(), nil
}

// walkStruct adds t's fields under prefix; vals are the probes' values of
// t there (invalid where a probe has none).
func (g *generator) walkStruct(t reflect.Type, prefix string, vals []probe) {
	for i := range t.NumField() {
		sf := t.Field(i)
		if !sf.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(sf.Tag.Get("yaml"), ",")
		if name == "-" {
			continue
		}
		sub := make([]probe, len(vals))
		for j, v := range vals {
			sub[j] = probe{fieldOf(v.defaulted, i), fieldOf(v.raw, i)}
		}
		if strings.Contains(opts, "inline") {
			g.walkStruct(sf.Type, prefix, sub)
			continue
		}
		if name == "" {
			name = strings.ToLower(sf.Name)
		}
		g.addField(t, sf, join(prefix, name), name, sub)
	}
}

func join(prefix, name string) string {
	if prefix == "" {
		return name
	}
	return prefix + "." + name
}

func fieldOf(v reflect.Value, i int) reflect.Value {
	if !v.IsValid() {
		return v
	}
	return v.Field(i)
}

// deref follows pointers, returning an invalid Value for nil.
func deref(v reflect.Value) reflect.Value {
	for v.IsValid() && v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return reflect.Value{}
		}
		v = v.Elem()
	}
	return v
}

// addField adds one field and, for a mapping, its section.
func (g *generator) addField(owner reflect.Type, sf reflect.StructField, path, key string, vals []probe) {
	ft := sf.Type
	for ft.Kind() == reflect.Pointer {
		ft = ft.Elem()
	}
	docKey := owner.Name() + "." + sf.Name
	doc, ok := g.src.fieldDocs[docKey]
	if strings.TrimSpace(doc) == "" {
		doc, ok = g.src.typeDocs[ft.Name()], ft.Name() != ""
		if ok {
			doc = strings.Replace(doc, ft.Name()+" ", sf.Name+" ", 1)
		}
	}
	if !ok || strings.TrimSpace(doc) == "" {
		g.errs = append(g.errs, fmt.Errorf("%s (%s): no doc comment on the field or its type", path, docKey))
		return
	}
	text, defMark, valuesMark := splitMarks(doc)
	f := field{path: path, doc: markdown(text, sf.Name, key)}

	// Lists of mappings and maps of mappings document their element's
	// fields under path[] and path.<key>.
	elem, elemPath := ft, path
	var elemVals []probe
	switch {
	case ft.Kind() == reflect.Slice && isStruct(ft.Elem()):
		elem, elemPath = ft.Elem(), path+"[]"
		f.typ = "list of mappings"
		for _, v := range vals {
			elemVals = append(elemVals, probe{index0(deref(v.defaulted)), index0(deref(v.raw))})
		}
	case ft.Kind() == reflect.Map && ft.Elem().Kind() == reflect.Slice && isStruct(ft.Elem().Elem()):
		k := mapKey[key]
		if k == "" {
			g.errs = append(g.errs, fmt.Errorf("%s: a map with no key name in mapKey", path))
			return
		}
		elem, elemPath = ft.Elem().Elem(), path+"."+k+"[]"
		f.typ = "map of `" + k + "` to list of mappings"
	case ft.Kind() == reflect.Map && isStruct(ft.Elem()):
		k := mapKey[key]
		if k == "" {
			g.errs = append(g.errs, fmt.Errorf("%s: a map with no key name in mapKey", path))
			return
		}
		elem, elemPath = ft.Elem(), path+"."+k
		for elem.Kind() == reflect.Pointer {
			elem = elem.Elem()
		}
		f.typ = "map of `" + k + "` to mapping"
		for _, v := range vals {
			elemVals = append(elemVals, probe{deref(mapIndex(deref(v.defaulted), config.DefaultConfigName)), deref(mapIndex(deref(v.raw), config.DefaultConfigName))})
		}
	case isStruct(ft):
		f.typ = "mapping"
		for _, v := range vals {
			elemVals = append(elemVals, probe{deref(v.defaulted), deref(v.raw)})
		}
	}
	if f.typ != "" {
		f.mapping = true
		f.sectionT = elem.Name()
		if at, done := g.seen[elem]; done {
			f.sameAs = at
			f.mapping = false
		}
		g.fields = append(g.fields, f)
		if f.mapping {
			g.seen[elem] = path
			g.walkStruct(elem, elemPath, elemVals)
		}
		return
	}

	f.typ = typeName(ft, key)
	if v := g.src.accepts[docKey]; v != nil {
		f.values = codeList(v)
	} else if v := g.src.typed[ft.Name()]; v != nil && ft.Kind() == reflect.String {
		f.values = codeList(v)
	}
	if valuesMark != "" {
		if f.values != "" {
			g.errs = append(g.errs, fmt.Errorf("%s: %q, while the constants say %s", path, markValues+valuesMark, f.values))
		}
		f.values = escapeHTML(valuesMark)
	}
	probed, err := probedDefault(vals)
	if err != nil {
		g.errs = append(g.errs, fmt.Errorf("%s: %w", path, err))
	}
	switch {
	case probed != "" && defMark != "" && "`"+probed+"`" != defMark:
		g.errs = append(g.errs, fmt.Errorf("%s: the doc comment says %q, Parse fills in %q", path, markDefault+defMark, probed))
	case probed != "":
		f.def = "`" + probed + "`"
	case defMark != "":
		f.def = escapeHTML(defMark)
	case ft.Kind() == reflect.Bool:
		f.def = "`false`"
	default:
		f.def = "none"
	}
	g.fields = append(g.fields, f)
}

func isStruct(t reflect.Type) bool {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t.Kind() == reflect.Struct && t != deviceIndicesType && t != replicaDevsType
}

func index0(v reflect.Value) reflect.Value {
	if !v.IsValid() || v.Len() == 0 {
		return reflect.Value{}
	}
	return v.Index(0)
}

func mapIndex(v reflect.Value, key string) reflect.Value {
	if !v.IsValid() || v.IsNil() {
		return reflect.Value{}
	}
	return v.MapIndex(reflect.ValueOf(key))
}

// probedDefault is the value Parse filled in where the probe left the field
// out, as YAML ("" when no probe shows one).
func probedDefault(vals []probe) (string, error) {
	for _, v := range vals {
		d, r := v.defaulted, v.raw
		if !d.IsValid() || !r.IsValid() || reflect.DeepEqual(d.Interface(), r.Interface()) {
			continue
		}
		if d = deref(d); !d.IsValid() {
			continue
		}
		b, err := yaml.Marshal(d.Interface())
		if err != nil {
			return "", err
		}
		return prettyDuration(strings.TrimSpace(string(b))), nil
	}
	return "", nil
}

var reWholeMinutes = regexp.MustCompile(`^([0-9]+h)?([0-9]+m)0s$`)

// prettyDuration writes 5m0s as 5m and 1h0m0s as 1h, as a user writes them.
func prettyDuration(s string) string {
	m := reWholeMinutes.FindStringSubmatch(s)
	switch {
	case m == nil:
		return s
	case m[1] != "" && m[2] == "0m":
		return m[1]
	}
	return m[1] + m[2]
}

// typeName is how the reference writes a field's type.
func typeName(t reflect.Type, key string) string {
	switch t {
	case durationType:
		return "duration (`30s`, `5m`)"
	case quantityType:
		return "quantity (bytes, or with a suffix: `20Gi`, `512M`)"
	case stringListType:
		return "string or list of strings"
	case deviceIndicesType:
		return "`all` or list of GPU indices"
	case replicaDevsType:
		return "`all`, a count, or list of device references"
	}
	switch t.Kind() {
	case reflect.Pointer:
		return typeName(t.Elem(), key)
	case reflect.Bool:
		return "bool"
	case reflect.Int, reflect.Int64:
		return "integer"
	case reflect.String:
		return "string"
	case reflect.Slice:
		return "list of " + plural(typeName(t.Elem(), key))
	case reflect.Map:
		k := mapKey[key]
		if k == "" {
			k = "key"
		}
		return "map of `" + k + "` to " + typeName(t.Elem(), key)
	}
	return t.String()
}

func plural(s string) string {
	switch s {
	case "integer", "string":
		return s + "s"
	}
	return s
}

func codeList(vs []string) string {
	out := make([]string, len(vs))
	for i, v := range vs {
		out[i] = "`" + v + "`"
	}
	return strings.Join(out, ", ")
}

// splitMarks takes the Default: and Values: lines out of a doc comment.
func splitMarks(doc string) (text, def, values string) {
	var keep []string
	for line := range strings.SplitSeq(doc, "\n") {
		switch {
		case strings.HasPrefix(line, markDefault):
			def = strings.TrimSuffix(strings.TrimPrefix(line, markDefault), ".")
		case strings.HasPrefix(line, markValues):
			values = strings.TrimSuffix(strings.TrimPrefix(line, markValues), ".")
		default:
			keep = append(keep, line)
		}
	}
	return strings.Join(keep, "\n"), def, values
}

// markdown joins a doc comment's lines into paragraphs and writes the Go
// name it starts with as the YAML key.
func markdown(text, goName, key string) string {
	var paras []string
	for p := range strings.SplitSeq(strings.TrimSpace(text), "\n\n") {
		paras = append(paras, strings.Join(strings.Fields(p), " "))
	}
	out := escapeHTML(strings.Join(paras, "\n\n"))
	for _, sep := range []string{" ", ","} {
		if rest, ok := strings.CutPrefix(out, goName+sep); ok {
			return "`" + key + "`" + sep + rest
		}
	}
	return out
}

// escapeHTML keeps <name> in prose from reading as an HTML tag, outside
// code spans.
func escapeHTML(s string) string {
	parts := strings.Split(s, "`")
	for i := 0; i < len(parts); i += 2 {
		parts[i] = strings.ReplaceAll(parts[i], "<", "&lt;")
	}
	return strings.Join(parts, "`")
}

// render writes the page.
func (g *generator) render() []byte {
	var b bytes.Buffer
	b.WriteString(`<!-- Code generated by "go run ./internal/configref" from config/types.go; DO NOT EDIT. -->

# Config field reference

Every field of gpu-agent's own config format (` + "`version: v1`" + ` with ` + "`configs:`" + `), by YAML path: its type,
its default when the field is left out, the values it accepts, and what it does. How a node picks its config, and
how NVIDIA's device-plugin and mig-parted files map onto these fields, is in [config.md](config.md).
` + "`<config>`, `<node>`, `<entry>` and `<profile>`" + ` stand for names you choose (a MIG profile's, for
` + "`<profile>`" + `); ` + "`[]`" + ` for each entry of a list.

This page is generated from the doc comments of ` + "`config/types.go`" + ` and the defaults ` + "`config.Parse`" + ` fills in:
edit those, then run ` + "`go run ./internal/configref`" + `.
`)
	for _, f := range g.fields {
		if f.mapping {
			fmt.Fprintf(&b, "\n## `%s`\n\n", f.path)
			fmt.Fprintf(&b, "Type: %s.\n\n%s\n", f.typ, f.doc)
			continue
		}
		fmt.Fprintf(&b, "\n### `%s`\n\n", f.path)
		if f.sameAs != "" {
			fmt.Fprintf(&b, "Type: %s, as [`%s`](#%s).\n\n%s\n", f.typ, f.sameAs, slug(f.sameAs), f.doc)
			continue
		}
		line := []string{"Type: " + f.typ, "default: " + f.def}
		if f.values != "" {
			line = append(line, "values: "+f.values)
		}
		fmt.Fprintf(&b, "%s.\n\n%s\n", strings.Join(line, "; "), f.doc)
	}
	return b.Bytes()
}

// slug is the anchor GitHub gives a heading.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || ('a' <= r && r <= 'z') || ('0' <= r && r <= '9'):
			b.WriteRune(r)
		}
	}
	return b.String()
}
