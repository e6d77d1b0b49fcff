package config

import (
	"fmt"
	"strings"
)

// hostileInput is a document built to make Parse spend as much memory or
// time as it can, at most MaxBytes long.
type hostileInput struct {
	name string
	data []byte
}

// fill appends unit to b until one more would take it past limit bytes.
func fill(b *strings.Builder, unit string, limit int) {
	for b.Len()+len(unit) <= limit {
		b.WriteString(unit)
	}
}

// hostileInputs returns the worst inputs found for each way a document can
// expand, each sized to reach size bytes (at most MaxBytes). Every one must
// be refused with an error, at a cost bounded by the input's size.
func hostileInputs(size int) []hostileInput {
	var out []hostileInput
	add := func(name string, b *strings.Builder) {
		out = append(out, hostileInput{name, []byte(b.String())})
	}
	var b strings.Builder

	// The densest node tree: two bytes a node.
	b.WriteString("version: v1\nconfigs: {}\nx: [")
	fill(&b, "a,", size-2)
	b.WriteString("a]")
	add("flat flow list", &b)

	b.Reset()
	b.WriteString("version: v1\nconfigs: {}\nx:\n")
	fill(&b, "- \n", size)
	add("block list of nulls", &b)

	// Billion laughs: nine levels of ten references each, reached through
	// merge keys so that the decoder walks every one of them (the anchors
	// sit under an unknown field, which is not walked).
	b.Reset()
	b.WriteString("version: v1\nlaughs:\n  l0: &l0 {passDeviceSpecs: true}\n")
	for i := 1; i < 9; i++ {
		fmt.Fprintf(&b, "  l%d: &l%d {<<: [", i, i)
		for j := range 10 {
			if j > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "*l%d", i-1)
		}
		b.WriteString("]}\n")
	}
	b.WriteString("configs:\n  default: {devicePlugin: *l8}\n")
	add("billion laughs", &b)

	// A long key is part of the path of everything under it, and the path
	// is stored once per decoded node.
	key := strings.Repeat("k", size/2)
	b.Reset()
	b.WriteString("version: v1\nconfigs:\n  ? " + key + "\n  :\n    sharing:\n      timeSlicing:\n        resources: [&r {name: nvidia.com/gpu, replicas: 2}")
	fill(&b, ",*r", size-1)
	b.WriteString("]")
	add("long key over aliases", &b)

	// A long value quoted by a validation error, once per alias.
	b.Reset()
	b.WriteString("version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources: [&r {name: " +
		strings.Repeat("n", size/2) + ", replicas: 2}")
	fill(&b, ",*r", size-1)
	b.WriteString("]")
	add("long value quoted per alias", &b)

	// A long device list, walked by its own UnmarshalYAML, once per alias.
	b.Reset()
	b.WriteString("version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n" +
		"        - {name: nvidia.com/gpu, replicas: 2, devices: &d [")
	fill(&b, "0,", size/2)
	b.WriteString("0]}\n")
	for i := 0; b.Len() < size-64; i++ {
		fmt.Fprintf(&b, "        - {name: nvidia.com/mig-%dg.1gb, replicas: 2, devices: *d}\n", i%7+1)
	}
	add("long device list per alias", &b)

	// Unknown fields are errors without a decoded value; each alias of the
	// mapping holding them repeats them all.
	b.Reset()
	b.WriteString("version: v1\nu: &u {")
	for i := 0; b.Len() < size/2; i++ {
		fmt.Fprintf(&b, "k%d: 0, ", i)
	}
	b.WriteString("z: 0}\nconfigs:\n")
	for i := 0; b.Len() < size-40; i++ {
		fmt.Fprintf(&b, "  c%d: {devicePlugin: *u}\n", i)
	}
	add("unknown fields per alias", &b)

	// Merge keys: many explicit keys and many merge sources, in a mapping
	// that is walked (nodes: is a map of strings).
	b.Reset()
	b.WriteString("version: v1\nm: &m {a: b}\nconfigs: {default: {}}\nnodes: {")
	for i := 0; b.Len() < size/2; i++ {
		fmt.Fprintf(&b, "n%d: default, ", i)
	}
	b.WriteString("<<: [*m")
	fill(&b, ",*m", size-2)
	b.WriteString("]}")
	add("merge sources times keys", &b)

	// The next two are pairwise checks in validation, which runs only on a
	// document within the decoder's budget: so they stay just under it.
	//
	// Layout entries that all claim GPU 0 (6 nodes each).
	b.Reset()
	b.WriteString("version: v1\nmig-configs:\n  x: [&e {devices: [0], mig-enabled: false}")
	for range min((size-b.Len())/3, maxNodes/6-10) {
		b.WriteString(",*e")
	}
	b.WriteString("]")
	add("layout claims per alias", &b)

	// Time-slicing and MPS entries of one name (5 nodes each): each
	// MPS entry overlaps each time-slicing one.
	b.Reset()
	each := min((size-200)/6, maxNodes/10-10)
	b.WriteString("version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n" +
		"        resources: [&t {name: nvidia.com/gpu, replicas: 2}")
	b.WriteString(strings.Repeat(",*t", each))
	b.WriteString("]\n      mps:\n        resources: [&m {name: nvidia.com/gpu, replicas: 2}")
	b.WriteString(strings.Repeat(",*m", each))
	b.WriteString("]")
	add("sharing overlaps per alias", &b)

	// Deep nesting stops in yaml.v3's parser (depth 10000).
	b.Reset()
	b.WriteString("version: v1\nconfigs: ")
	n := min((size-b.Len())/2, 20000)
	b.WriteString(strings.Repeat("[", n) + strings.Repeat("]", n))
	add("deep flow nesting", &b)

	return out
}
