// Package config reads the agent's one configuration file (a ConfigMap key):
// named configs for MIG, sharing, health and allocation, and which node uses
// which. It decodes strictly, applies defaults, validates with field paths
// and lines, accepts NVIDIA device-plugin and mig-parted files as they are,
// and watches a mounted ConfigMap for changes.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"gopkg.in/yaml.v3"
)

// MaxStructure bounds the YAML indicators a config may hold (each ',', ':',
// '-', '[' and '{' counts, also inside strings, so the count is an upper
// bound on the nodes parsing would build). The GPU Operator's whole default
// mig-parted config has about 1,000.
const MaxStructure = 100_000

// structuralBytes counts the bytes that can start or separate a YAML node.
func structuralBytes(data []byte) int {
	n := 0
	for _, b := range data {
		switch b {
		case ',', ':', '-', '[', '{':
			n++
		}
	}
	return n
}

// Parse decodes a config file strictly, applies defaults and validates it.
// The format (gpu-agent, NVIDIA device plugin, mig-parted) is detected from
// the top-level keys. Warnings are for things that are accepted but probably
// not what the author meant, or fields of another format that the agent
// ignores. The error, when not nil, is an ErrorList.
func Parse(data []byte) (*File, []string, error) {
	return parse(data, newDecoder(), checkAll, ParseOptions{})
}

// parse is Parse with the decoder (whose budget may already be partly
// spent, by earlier keys of a ConfigMap), the checks to run and the agent's
// options.
func parse(data []byte, d *decoder, what checks, o ParseOptions) (*File, []string, error) {
	if len(data) > MaxBytes {
		// Refused before parsing: the YAML tree alone costs about a hundred
		// times the input's size.
		return nil, nil, ErrorList{{Msg: fmt.Sprintf("config of %d bytes exceeds the maximum of %d bytes (a ConfigMap's limit)",
			len(data), MaxBytes)}}
	}
	if n := structuralBytes(data); n > MaxStructure {
		// yaml.v3 builds a node per item at about 126 bytes each: a 1 MiB
		// list of one-byte items would take 130 MB, more than the agent's
		// memory limit. No real config comes near this many.
		return nil, nil, ErrorList{{Msg: fmt.Sprintf("config has %d YAML indicators (',', ':', '-', '[', '{'), more than the %d a config can need; refused unparsed to bound memory",
			n, MaxStructure)}}
	}
	root, err := parseNode(data)
	if err != nil {
		return nil, nil, err
	}
	format, err := detectFormat(root)
	if err != nil {
		return nil, nil, err
	}

	var f *File
	var warnings []string
	var importErrs ErrorList
	switch format {
	case FormatGPUAgent:
		f = &File{}
		d.decode(root, reflect.ValueOf(f).Elem(), "")
		f.Format = FormatGPUAgent
	case FormatNVIDIADevicePlugin:
		var nf nvdpFile
		// NVIDIA's parser ignores keys it does not know (it decodes
		// through encoding/json): warn about them instead of refusing a
		// file that works there.
		d.lenient = true
		d.decode(root, reflect.ValueOf(&nf).Elem(), "")
		f, warnings, importErrs = fromNVIDIA(&nf, d.lines, o)
	case FormatMigParted:
		var mf migPartedFile
		d.decode(root, reflect.ValueOf(&mf).Elem(), "")
		f = fromMigParted(&mf, o)
	}
	warnings = append(d.warnings, warnings...)
	fillMIGStrategy(f, o)
	f.lines = d.lines
	if d.tooLarge {
		return nil, nil, d.errs.err() // validating a truncated document would only add noise
	}

	// Validate even after decode errors, so one run reports everything
	// (a misspelt "replica" and the then missing "replicas"); but a field
	// that failed to decode holds a zero value, so drop validation errors
	// at or under a path that already has a decode error.
	applyDefaults(f)
	v := newValidator(f, what)
	v.file()
	warnings = append(warnings, v.warnings...)
	errs := append(slices.Clip(d.errs), importErrs...)
	for _, e := range v.errs {
		if !underAny(e.Path, d.errs) {
			errs = append(errs, e)
		}
	}
	if len(errs) > 0 {
		return nil, warnings, errs.err()
	}
	return f, warnings, nil
}

// underAny reports whether path is, or is inside, the path of one of errs.
func underAny(path string, errs ErrorList) bool {
	for _, e := range errs {
		if e.Path == "" || path == e.Path ||
			strings.HasPrefix(path, e.Path+".") || strings.HasPrefix(path, e.Path+"[") {
			return true
		}
	}
	return false
}

// Load reads (with ReadFile's bounds) and parses a config file. Symlinks
// are followed, as a mounted ConfigMap key is a symlink into the ..data
// directory.
func Load(path string) (*File, []string, error) {
	data, err := ReadFile(path)
	if err != nil {
		return nil, nil, err // names the path already
	}
	f, warnings, err := Parse(data)
	if err != nil {
		return nil, warnings, fmt.Errorf("config %s: %w", path, err)
	}
	return f, warnings, nil
}

// Default is a file of one config with every default: whole GPUs, MIG
// strategy none, no MIG changes, no sharing, topology-aware allocation.
// The agent without a config runs BuiltIn, which also serves MIG devices.
func Default() *File {
	f := &File{
		Version: Version,
		Format:  FormatGPUAgent,
		Configs: map[string]*Config{DefaultConfigName: {}},
	}
	applyDefaults(f)
	return f
}

// Marshal writes f in the gpu-agent format, whatever format it was read
// from; Parse reads the result back to an equivalent File.
func (f *File) Marshal() ([]byte, error) {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(f); err != nil {
		return nil, fmt.Errorf("marshal config: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("marshal config: %w", err)
	}
	return buf.Bytes(), nil
}

var reYAMLLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// parseNode parses exactly one YAML document into its root mapping.
func parseNode(data []byte) (*yaml.Node, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, ErrorList{{Msg: "empty config file"}}
		}
		return nil, ErrorList{syntaxError(err, data)}
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err == nil {
		return nil, ErrorList{{Line: extra.Line, Msg: "more than one YAML document; a config file holds one"}}
	} else if !errors.Is(err, io.EOF) {
		return nil, ErrorList{syntaxError(err, data)}
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 {
		return nil, ErrorList{{Msg: "empty config file"}}
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, ErrorList{{Line: root.Line, Msg: "expected a mapping at the top level, got " + describe(root)}}
	}
	return root, nil
}

func syntaxError(err error, data []byte) *FieldError {
	if m := reYAMLLine.FindStringSubmatch(err.Error()); m != nil {
		line, _ := strconv.Atoi(m[1])
		if fe := tabError(line, m[2], data); fe != nil {
			return fe
		}
		return &FieldError{Line: line, Msg: "invalid YAML: " + m[2]}
	}
	return &FieldError{Msg: "invalid YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")}
}

// tabError says "tab" for the errors yaml.v3 gives a tab where YAML wants
// spaces ("found character that cannot start any token", "found a tab
// character that violates indentation"), at the tab's line and column:
// yaml.v3 names the line before the tab for the second kind. nil when msg is
// not such an error, or no tab is found where it points.
func tabError(line int, msg string, data []byte) *FieldError {
	lines := strings.Split(string(data), "\n")
	var candidates []int
	switch {
	case strings.Contains(msg, "cannot start any token"):
		candidates = []int{line}
	case strings.Contains(msg, "tab character"):
		candidates = []int{line, line + 1}
	}
	for _, l := range candidates {
		if l < 1 || l > len(lines) {
			continue
		}
		text := lines[l-1]
		col := strings.IndexByte(text, '\t')
		if col < 0 {
			continue
		}
		where, before := "indenting the line", strings.TrimRight(text[:col], " ")
		if before != "" {
			// A tab may be in a quoted value; a token that cannot start
			// is one after an indicator.
			if !strings.Contains(msg, "tab character") && !strings.ContainsAny(before[len(before)-1:], "-:,[{?") {
				continue
			}
			where = "before " + strconv.Quote(strings.TrimSpace(text[col:]))
		}
		return &FieldError{Line: l, Msg: fmt.Sprintf("invalid YAML: a tab (column %d, %s): YAML indents with spaces, never tabs (%s)",
			utf8.RuneCountInString(text[:col])+1, where, msg)}
	}
	return nil
}

// detectFormat looks at the top-level keys: configs/nodes are ours; flags,
// sharing, resources, imex or health are the NVIDIA device plugin's;
// mig-configs alone is mig-parted. Keys of two formats mixed are reported by
// the strict decoder of the format chosen here.
func detectFormat(root *yaml.Node) (Format, error) {
	keys := map[string]bool{}
	for i := 0; i+1 < len(root.Content); i += 2 {
		keys[root.Content[i].Value] = true
	}
	switch {
	case keys["configs"] || keys["nodes"]:
		return FormatGPUAgent, nil
	case keys["flags"] || keys["sharing"] || keys["resources"] || keys["imex"] || keys["health"]:
		return FormatNVIDIADevicePlugin, nil
	case keys["mig-configs"]:
		return FormatMigParted, nil
	}
	msg := "unrecognised config file: expected top-level configs: (gpu-agent), " +
		"flags:/sharing: (NVIDIA device plugin) or mig-configs: (mig-parted)"
	known := []string{"configs", "flags", "health", "imex", "mig-configs", "nodes", "resources", "sharing", "version"}
	for i := 0; i+1 < len(root.Content) && i < 2*maxListed; i += 2 {
		key := root.Content[i].Value
		if name := closest(key, known); name != "" && name != key {
			msg += fmt.Sprintf("; %s (line %d): did you mean %s?", key, root.Content[i].Line, name)
		}
	}
	return "", ErrorList{{Line: root.Line, Msg: msg}}
}

// applyDefaults fills every field left empty with its default, in one place.
// It never overwrites a value the user set.
func applyDefaults(f *File) {
	for name, c := range f.Configs {
		if c == nil {
			c = &Config{}
			f.Configs[name] = c
		}
		if c.DevicePlugin.DeviceListStrategy == "" {
			c.DevicePlugin.DeviceListStrategy = DeviceListStrategyEnvvar
		}
		if c.DevicePlugin.CDIAnnotationPrefix == "" {
			c.DevicePlugin.CDIAnnotationPrefix = DefaultCDIAnnotationPrefix
		}
		if c.DevicePlugin.DeviceIDStrategy == "" {
			c.DevicePlugin.DeviceIDStrategy = DeviceIDStrategyUUID
		}
		if c.Allocation.Policy == "" {
			c.Allocation.Policy = PolicyTopology
		}
		if c.MIG.Strategy == "" {
			c.MIG.Strategy = MIGStrategyNone
		}
		if ts := c.Sharing.TimeSlicing; ts != nil {
			if ts.FailRequestsGreaterThanOne == nil {
				ts.FailRequestsGreaterThanOne = new(false)
			}
			for i := range ts.Resources {
				defaultReplicated(&ts.Resources[i], ts.RenameByDefault)
			}
		}
		if mps := c.Sharing.MPS; mps != nil {
			if mps.FailRequestsGreaterThanOne == nil {
				mps.FailRequestsGreaterThanOne = new(true)
			}
			for i := range mps.Resources {
				defaultReplicated(&mps.Resources[i].ReplicatedResource, mps.RenameByDefault)
			}
		}
		if c.Health.RecoveryQuietPeriod == 0 {
			c.Health.RecoveryQuietPeriod = Duration(DefaultRecoveryQuietPeriod)
		}
		if c.Health.ProbeInterval == 0 {
			c.Health.ProbeInterval = Duration(DefaultProbeInterval)
		}
	}
}

// SharedSuffix is appended to a resource name by renameByDefault, as NVIDIA does.
const SharedSuffix = ".shared"

func defaultReplicated(r *ReplicatedResource, renameByDefault bool) {
	if r.Devices.IsZero() {
		r.Devices = ReplicaDevices{All: true}
	}
	if r.Rename == "" && renameByDefault && r.Name != "" {
		r.Rename = r.Name + SharedSuffix
	}
}
