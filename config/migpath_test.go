package config

import (
	"errors"
	"testing"
)

// A layout the planner refuses is named where its author wrote it: a
// mig-parted entry under mig-configs, whatever config or label picked it,
// with the ConfigMap key and the line (issue 32).
func TestMIGErrorNamesTheAuthorsPath(t *testing.T) {
	const migParted = `version: v1
mig-configs:
  all-disabled:
  - devices: all
    mig-enabled: false
  five-1g-one-2g:
  - device-filter: ["0x20B010DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.5gb": 5
      "2g.10gb": 1
`
	const own = `version: v1
configs:
  big:
    mig:
      strategy: mixed
      devices:
      - devices: all
        mig-enabled: true
        mig-devices: {"7g.40gb": 1}
`
	cause := errors.New("profile 4g.40gb not offered")
	for _, tt := range []struct {
		name   string
		parse  func() (*File, error)
		labels map[string]string
		entry  int
		field  string
		want   string
	}{
		{"mig-parted file, by the label", func() (*File, error) { f, _, err := Parse([]byte(migParted)); return f, err },
			map[string]string{MIGConfigLabel: "five-1g-one-2g"}, 0, "mig-devices",
			"mig-configs.five-1g-one-2g[0].mig-devices: profile 4g.40gb not offered (line 10)"},
		{"mig-parted file, by the config label", func() (*File, error) { f, _, err := Parse([]byte(migParted)); return f, err },
			map[string]string{ConfigLabel: "five-1g-one-2g"}, 0, "",
			"mig-configs.five-1g-one-2g[0]: profile 4g.40gb not offered (line 7)"},
		{"own layout", func() (*File, error) { f, _, err := Parse([]byte(own)); return f, err },
			map[string]string{ConfigLabel: "big"}, 0, "mig-devices",
			"configs.big.mig.devices[0].mig-devices: profile 4g.40gb not offered (line 9)"},
		{"ConfigMap keys", func() (*File, error) {
			f, _, err := ParseConfigMap(map[string]string{"mig.yaml": migParted, "own.yaml": own}, "")
			return f, err
		}, map[string]string{ConfigLabel: "big", MIGConfigLabel: "five-1g-one-2g"}, 0, "mig-devices",
			"key mig.yaml: mig-configs.five-1g-one-2g[0].mig-devices: profile 4g.40gb not offered (line 10)"},
		{"ConfigMap key of the config's own layout", func() (*File, error) {
			f, _, err := ParseConfigMap(map[string]string{"mig.yaml": migParted, "own.yaml": own}, "")
			return f, err
		}, map[string]string{ConfigLabel: "big"}, -1, "",
			"key own.yaml: configs.big.mig.devices: profile 4g.40gb not offered (line 6)"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f, err := tt.parse()
			if err != nil {
				t.Fatal(err)
			}
			sel, err := f.Select("node", tt.labels)
			if err != nil {
				t.Fatal(err)
			}
			err = sel.MIGError(tt.entry, tt.field, cause)
			if err.Error() != tt.want {
				t.Errorf("MIGError = %q, want %q", err, tt.want)
			}
			if !errors.Is(err, cause) {
				t.Error("MIGError does not wrap its cause")
			}
		})
	}
}
