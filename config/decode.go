package config

import (
	"fmt"
	"maps"
	"reflect"
	"slices"
	"sort"
	"strings"

	"gopkg.in/yaml.v3"
)

// Bounds on the decoder's work. A few anchors referencing each other can
// describe an exponentially large document ("billion laughs"), and yaml.v3
// does not expand aliases in a yaml.Node tree, so this walk is where they
// are bounded: in nodes visited after expanding aliases, mapping entries
// included, and in bytes of the scalar values visited. Everything built
// from the document (values, paths, line records, error messages, which
// quote at most a value or two each) then grows with these, not with the
// expanded document.
const (
	maxNodes = 50000
	// maxValueBytes leaves a document without aliases, which cannot hold
	// more than MaxBytes of values, far below the bound.
	maxValueBytes = 4 * MaxBytes
	// maxKeyBytes bounds a mapping key, which is part of the path (and line
	// record, and error) of everything under it. 253, the longest node name
	// (a DNS subdomain), is the longest key the schema has use for.
	maxKeyBytes = 253
)

// decoder maps a yaml.Node tree onto Go values by their yaml tags, strictly:
// yaml.v3's KnownFields reports unknown fields without their path, and stops
// at the first type error, so the walk is done here to report every problem
// with the path and line it concerns.
type decoder struct {
	errs  ErrorList
	lines map[string]int
	// Work done so far, against maxNodes and maxValueBytes; tooLarge is set
	// (and reported once) when either is exceeded, and ends the walk.
	nodes    int
	bytes    int
	tooLarge bool
	// shared: the budget is the whole ConfigMap's, carried from key to key
	// (see ParseConfigMap), which the error then says.
	shared bool
	// lenient reads a key the schema lacks as NVIDIA's parser (which
	// decodes through encoding/json) does: one that names a field but for
	// case is that field, any other is ignored. Each is a warning, at most
	// maxLenientWarnings of them, so a file of thousands of unknown keys
	// gives a short list.
	lenient  bool
	warnings []string
	unknown  int
	// suggested counts the unknown fields given a "did you mean", against
	// maxSuggestions (carried from key to key of a ConfigMap, as the budget
	// is).
	suggested int
}

// maxSuggestions bounds the unknown fields compared with the schema's for a
// "did you mean": a file of thousands of unknown keys gets the first ones.
const maxSuggestions = 100

// maxLenientWarnings bounds the warnings a lenient decode lists one by one.
const maxLenientWarnings = 20

// warnf records a warning at path, written as a FieldError is.
func (d *decoder) warnf(path string, line int, format string, args ...any) {
	d.unknown++
	switch {
	case d.unknown <= maxLenientWarnings:
		w := &FieldError{Path: path, Line: line, Msg: fmt.Sprintf(format, args...)}
		d.warnings = append(d.warnings, w.Error())
	case d.unknown == maxLenientWarnings+1:
		d.warnings = append(d.warnings, fmt.Sprintf("more than %d unknown or mis-cased fields; the rest are ignored without a warning each", maxLenientWarnings))
	}
}

// foldField finds the field a key names but for case (encoding/json's
// matching), in field order.
func foldField(fields map[string][]int, key string) (string, []int, bool) {
	names := make([]string, 0, len(fields))
	for name := range fields {
		names = append(names, name)
	}
	sort.Slice(names, func(i, j int) bool {
		a, b := fields[names[i]], fields[names[j]]
		for k := 0; k < len(a) && k < len(b); k++ {
			if a[k] != b[k] {
				return a[k] < b[k]
			}
		}
		return len(a) < len(b)
	})
	for _, name := range names {
		if strings.EqualFold(name, key) {
			return name, fields[name], true
		}
	}
	return "", nil, false
}

func newDecoder() *decoder { return &decoder{lines: map[string]int{}} }

func (d *decoder) errorf(path string, line int, format string, args ...any) {
	d.errs = append(d.errs, &FieldError{Path: path, Line: line, Msg: fmt.Sprintf(format, args...)})
}

var unmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()

// spend counts nodes and value bytes against the bounds; false once either
// is exceeded, when the walk must stop.
func (d *decoder) spend(path string, line, nodes, bytes int) bool {
	if d.tooLarge {
		return false
	}
	d.nodes += nodes
	d.bytes += bytes
	what, where := "document", ""
	if d.shared {
		what, where = "ConfigMap", " in all keys"
	}
	switch {
	case d.nodes > maxNodes:
		d.errorf(path, line, "%s too large (more than %d nodes%s after expanding aliases)", what, maxNodes, where)
	case d.bytes > maxValueBytes:
		d.errorf(path, line, "%s too large (more than %d bytes of values%s after expanding aliases)", what, maxValueBytes, where)
	default:
		return true
	}
	d.tooLarge = true
	return false
}

// spendTree counts what is under n, for the yaml.Unmarshalers of this
// package, which walk n themselves; the aliases in it they do not follow.
func (d *decoder) spendTree(path string, n *yaml.Node) bool {
	for _, c := range n.Content {
		if !d.spend(path, c.Line, 1, len(c.Value)) || !d.spendTree(path, c) {
			return false
		}
	}
	return true
}

// decode stores n into v (which must be settable) and records path's line.
func (d *decoder) decode(n *yaml.Node, v reflect.Value, path string) {
	if !d.spend(path, n.Line, 1, 0) {
		return
	}
	for depth := 0; n.Kind == yaml.AliasNode; depth++ {
		if n.Alias == nil || depth > 100 {
			d.errorf(path, n.Line, "unresolvable alias")
			return
		}
		n = n.Alias
	}
	if n.Kind == yaml.ScalarNode && !d.spend(path, n.Line, 0, len(n.Value)) {
		return
	}
	if _, ok := d.lines[path]; !ok {
		d.lines[path] = n.Line
	}
	isNull := n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"

	if v.Kind() == reflect.Pointer {
		if isNull {
			v.SetZero()
			return
		}
		if v.IsNil() {
			v.Set(reflect.New(v.Type().Elem()))
		}
		d.decode(n, v.Elem(), path)
		return
	}
	if v.CanAddr() && v.Addr().Type().Implements(unmarshalerType) {
		if isNull {
			v.SetZero()
			return
		}
		if !d.spendTree(path, n) {
			return
		}
		if err := v.Addr().Interface().(yaml.Unmarshaler).UnmarshalYAML(n); err != nil {
			msg := err.Error()
			if strings.HasPrefix(msg, "[") {
				// An element of a list field failed: put its index in the path.
				if i := strings.Index(msg, "]: "); i > 0 {
					d.errorf(path+msg[:i+1], n.Line, "%s", msg[i+3:])
					return
				}
			}
			d.errorf(path, n.Line, "%s", msg)
		}
		return
	}

	switch v.Kind() {
	case reflect.Struct:
		if isNull {
			return
		}
		if n.Kind != yaml.MappingNode {
			d.errorf(path, n.Line, "expected a mapping, got %s", describe(n))
			return
		}
		fields := structFields(v.Type())
		d.mapping(n, path, map[string]int{}, func(key string, kn, vn *yaml.Node) {
			name := key
			idx, ok := fields[key]
			if !ok && d.lenient {
				if name, idx, ok = foldField(fields, key); ok {
					d.warnf(joinKey(path, key), kn.Line, "read as %s, as NVIDIA's parser matches field names regardless of case", name)
				}
			}
			if !ok {
				hint := d.suggest(fields, key)
				if d.lenient {
					d.warnf(joinKey(path, key), kn.Line, "unknown field, ignored as NVIDIA's device plugin ignores it%s", hint)
					return
				}
				d.errorf(joinKey(path, key), kn.Line, "unknown field%s", hint)
				return
			}
			d.keyLine(joinKey(path, name), kn)
			d.decode(vn, v.FieldByIndex(idx), joinKey(path, name))
		})
	case reflect.Map:
		if isNull {
			v.SetZero()
			return
		}
		if n.Kind != yaml.MappingNode {
			d.errorf(path, n.Line, "expected a mapping, got %s", describe(n))
			return
		}
		if v.IsNil() {
			v.Set(reflect.MakeMap(v.Type()))
		}
		d.mapping(n, path, map[string]int{}, func(key string, kn, vn *yaml.Node) {
			d.keyLine(joinKey(path, key), kn)
			elem := reflect.New(v.Type().Elem()).Elem()
			d.decode(vn, elem, joinKey(path, key))
			v.SetMapIndex(reflect.ValueOf(key).Convert(v.Type().Key()), elem)
		})
	case reflect.Slice:
		if isNull {
			v.SetZero()
			return
		}
		if n.Kind != yaml.SequenceNode {
			d.errorf(path, n.Line, "expected a list, got %s", describe(n))
			return
		}
		s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
		for i, item := range n.Content {
			d.decode(item, s.Index(i), joinIndex(path, i))
		}
		v.Set(s)
	case reflect.String:
		if n.Kind != yaml.ScalarNode {
			d.errorf(path, n.Line, "expected a string, got %s", describe(n))
			return
		}
		if isNull {
			v.SetString("")
			return
		}
		v.SetString(n.Value)
	case reflect.Bool:
		var b bool
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!bool" || n.Decode(&b) != nil {
			d.errorf(path, n.Line, "expected true or false, got %s", describe(n))
			return
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		var i int64
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" || n.Decode(&i) != nil || v.OverflowInt(i) {
			d.errorf(path, n.Line, "expected an integer, got %s", describe(n))
			return
		}
		v.SetInt(i)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		var u uint64
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" || n.Decode(&u) != nil || v.OverflowUint(u) {
			d.errorf(path, n.Line, "expected a non-negative integer, got %s", describe(n))
			return
		}
		v.SetUint(u)
	default:
		// Only reachable by adding a field of a new kind to the schema.
		d.errorf(path, n.Line, "internal error: cannot decode into %s", v.Type())
	}
}

// keyLine records a mapping entry at its key's line: for a block value the
// key is where a reader looks, the value starts on the next line.
func (d *decoder) keyLine(path string, kn *yaml.Node) {
	if _, ok := d.lines[path]; !ok {
		d.lines[path] = kn.Line
	}
}

// mapping calls fn for each key of n, following merge keys ("<<") and
// reporting duplicate keys, which YAML forbids and yaml.v3 only detects when
// decoding into Go values. seen holds the keys n has delivered so far, by
// the line of an explicit key (0 for a merged one).
func (d *decoder) mapping(n *yaml.Node, path string, seen map[string]int, fn func(key string, kn, vn *yaml.Node)) {
	if len(n.Content)%2 != 0 {
		d.errorf(path, n.Line, "malformed mapping")
		return
	}
	// Explicit keys win over merged ones, so visit them first.
	var merges []*yaml.Node
	for i := 0; i < len(n.Content); i += 2 {
		kn, vn := n.Content[i], n.Content[i+1]
		// Each entry counts: one that only produces an error (an unknown
		// field) would otherwise be free to repeat through an alias.
		if !d.spend(path, kn.Line, 1, len(kn.Value)) {
			return
		}
		if kn.Kind == yaml.ScalarNode && kn.ShortTag() == "!!merge" {
			merges = append(merges, vn)
			continue
		}
		if kn.Kind != yaml.ScalarNode {
			d.errorf(path, kn.Line, "expected a string key, got %s", describe(kn))
			continue
		}
		if len(kn.Value) > maxKeyBytes {
			d.errorf(path, kn.Line, "key %s of %d bytes exceeds the maximum of %d bytes", describe(kn), len(kn.Value), maxKeyBytes)
			continue
		}
		if first, dup := seen[kn.Value]; dup {
			if first > 0 { // merged keys are recorded as 0: overriding them is allowed
				d.errorf(joinKey(path, kn.Value), kn.Line, "duplicate key (first at line %d)", first)
			}
			continue
		}
		seen[kn.Value] = kn.Line
		fn(kn.Value, kn, vn)
	}
	for _, m := range merges {
		for m.Kind == yaml.AliasNode && m.Alias != nil {
			m = m.Alias
		}
		var sources []*yaml.Node
		switch m.Kind {
		case yaml.MappingNode:
			sources = []*yaml.Node{m}
		case yaml.SequenceNode:
			sources = m.Content
		default:
			d.errorf(path, m.Line, "merge key (<<) needs a mapping or a list of mappings, got %s", describe(m))
			continue
		}
		for _, src := range sources {
			if !d.spend(path, src.Line, 1, 0) {
				return
			}
			for src.Kind == yaml.AliasNode && src.Alias != nil {
				src = src.Alias
			}
			if src.Kind != yaml.MappingNode {
				d.errorf(path, src.Line, "merge key (<<) needs a mapping, got %s", describe(src))
				continue
			}
			// Merged keys never override explicit ones, nor earlier merges.
			// The source gets a map of its own for its duplicates, rather
			// than a copy of seen: copying per source would be quadratic.
			d.mapping(src, path, map[string]int{}, func(key string, kn, vn *yaml.Node) {
				if _, ok := seen[key]; ok {
					return
				}
				seen[key] = 0
				fn(key, kn, vn)
			})
		}
	}
}

// suggest is "; did you mean <field>?" for the field of fields that key is
// a typo of, "" when none is close (see closest).
func (d *decoder) suggest(fields map[string][]int, key string) string {
	if d.suggested >= maxSuggestions {
		return ""
	}
	d.suggested++
	if name := closest(key, slices.Sorted(maps.Keys(fields))); name != "" {
		return "; did you mean " + name + "?"
	}
	return ""
}

// closest is the name that key is most likely a typo of: the nearest by
// edit distance (insertions, deletions, substitutions and transpositions
// of adjacent letters; case ignored), the first of names on a tie, when
// that is at most a quarter of the name's length (at least 1, at most 3);
// "" when none is that close.
func closest(key string, names []string) string {
	const maxLen = 64 // longer than any field name
	if len(key) > maxLen {
		return ""
	}
	best, bestDist := "", 0
	for _, name := range names {
		limit := min(max(len(name)/4, 1), 3)
		if abs(len(name)-len(key)) > limit {
			continue
		}
		if dist := editDistance(strings.ToLower(key), strings.ToLower(name)); dist <= limit && (best == "" || dist < bestDist) {
			best, bestDist = name, dist
		}
	}
	return best
}

func abs(n int) int {
	if n < 0 {
		return -n
	}
	return n
}

// editDistance is the optimal string alignment distance between a and b,
// by bytes.
func editDistance(a, b string) int {
	// Three rows: the one before last is for transpositions.
	prev2, prev, cur := make([]int, len(b)+1), make([]int, len(b)+1), make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}

// structFields maps yaml keys to field indices, following ",inline" structs.
// It is recomputed per call rather than cached, to keep the package free of
// shared mutable state; configs are small.
func structFields(t reflect.Type) map[string][]int {
	out := map[string][]int{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("yaml")
		name, opts, _ := strings.Cut(tag, ",")
		if name == "-" {
			continue
		}
		if strings.Contains(","+opts+",", ",inline,") && f.Type.Kind() == reflect.Struct {
			for k, idx := range structFields(f.Type) {
				out[k] = append([]int{i}, idx...)
			}
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		out[name] = []int{i}
	}
	return out
}
