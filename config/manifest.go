package config

import (
	"fmt"

	"gopkg.in/yaml.v3"
)

// ConfigMapManifest reads data as a Kubernetes ConfigMap manifest, the file
// `kubectl apply -f` takes (deploy/examples holds such files), and returns
// its data: every key a config file, as the agent reads the ConfigMap
// mounted as a directory or through the API (ParseConfigMap). isManifest is
// false, with no error, when data is not a ConfigMap manifest (a config file
// of one of the three formats, or not YAML at all: Parse says why); err says
// what is wrong with a file whose kind is ConfigMap.
//
// Only a ConfigMap's data can hold configs: binaryData is refused, and the
// other fields of the object (metadata, immutable) are not looked at. The
// bounds of a config file apply to the whole manifest.
func ConfigMapManifest(data []byte) (keys map[string]string, isManifest bool, err error) {
	if len(data) > MaxBytes || structuralBytes(data) > MaxStructure {
		return nil, false, nil // Parse refuses it, naming the bound
	}
	root, err := parseNode(data)
	if err != nil {
		return nil, false, nil
	}
	fields := map[string]*yaml.Node{}
	for i := 0; i+1 < len(root.Content); i += 2 {
		fields[root.Content[i].Value] = root.Content[i+1]
	}
	if kind := fields["kind"]; kind == nil || kind.Kind != yaml.ScalarNode || kind.Value != "ConfigMap" {
		return nil, false, nil
	}
	var errs ErrorList
	if v := fields["apiVersion"]; v == nil || v.Kind != yaml.ScalarNode || v.Value != "v1" {
		errs = append(errs, &FieldError{Line: root.Line, Path: "apiVersion", Msg: "a ConfigMap is apiVersion v1"})
	}
	if b := fields["binaryData"]; b != nil {
		errs = append(errs, &FieldError{Line: b.Line, Path: "binaryData", Msg: "configs are text: put them under data"})
	}
	d := fields["data"]
	switch {
	case d == nil:
		errs = append(errs, &FieldError{Line: root.Line, Path: "data", Msg: "a ConfigMap of configs needs data, every key a config"})
	case d.Kind != yaml.MappingNode:
		errs = append(errs, &FieldError{Line: d.Line, Path: "data", Msg: "expected a mapping of key to config, got " + describe(d)})
	default:
		keys = map[string]string{}
		for i := 0; i+1 < len(d.Content); i += 2 {
			k, v := d.Content[i], d.Content[i+1]
			path := "data." + k.Value
			switch {
			case k.Kind != yaml.ScalarNode || k.Value == "":
				errs = append(errs, &FieldError{Line: k.Line, Path: "data", Msg: "expected a key name, got " + describe(k)})
			case v.Kind != yaml.ScalarNode:
				errs = append(errs, &FieldError{Line: v.Line, Path: path, Msg: "expected a config as a string (data: {key: |, ...}), got " + describe(v)})
			case hasKey(keys, k.Value):
				errs = append(errs, &FieldError{Line: k.Line, Path: path, Msg: "key given twice"})
			default:
				keys[k.Value] = v.Value
			}
		}
	}
	if len(errs) > 0 {
		return nil, true, fmt.Errorf("ConfigMap manifest: %w", errs)
	}
	return keys, true, nil
}

func hasKey(m map[string]string, k string) bool {
	_, ok := m[k]
	return ok
}
