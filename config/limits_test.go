package config

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
)

func TestParseRefusesOversize(t *testing.T) {
	valid := "version: v1\nconfigs:\n  default: {}\n"
	pad := func(n int) []byte {
		// A comment pads the file to exactly n bytes without changing it.
		return []byte(valid + "#" + strings.Repeat("x", n-len(valid)-2) + "\n")
	}
	if _, _, err := Parse(pad(MaxBytes)); err != nil {
		t.Fatalf("a config of exactly MaxBytes refused: %v", err)
	}
	_, _, err := Parse(pad(MaxBytes + 1))
	checkErrors(t, err, []wantErr{{"", 0, fmt.Sprintf("config of %d bytes exceeds the maximum of %d bytes", MaxBytes+1, MaxBytes)}})
}

func TestReplicasBound(t *testing.T) {
	ours := func(policy, replicas string) string {
		return "version: v1\nconfigs:\n  default:\n    sharing:\n      " + policy + ":\n        resources:\n" +
			"        - name: nvidia.com/gpu\n          replicas: " + replicas + "\n"
	}
	nvidia := func(replicas string) string {
		return "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: " + replicas + "\n"
	}
	const tsPath = "configs.default.sharing.timeSlicing.resources[0].replicas"
	tests := []struct {
		name string
		in   string
		want []wantErr // nil: accepted
	}{
		{"at the bound", ours("timeSlicing", fmt.Sprint(MaxReplicas)), nil},
		{"one over", ours("timeSlicing", fmt.Sprint(MaxReplicas+1)),
			[]wantErr{{tsPath, 8, fmt.Sprintf("%d exceeds the maximum of %d", MaxReplicas+1, MaxReplicas)}}},
		{"the probe's value", ours("timeSlicing", "100000"),
			[]wantErr{{tsPath, 8, fmt.Sprintf("100000 exceeds the maximum of %d", MaxReplicas)}}},
		{"MPS", ours("mps", "1000000000"),
			[]wantErr{{"configs.default.sharing.mps.resources[0].replicas", 8, "1000000000 exceeds the maximum"}}},
		{"largest int64", ours("timeSlicing", "9223372036854775807"),
			[]wantErr{{tsPath, 8, "9223372036854775807 exceeds the maximum"}}},
		{"hexadecimal", ours("timeSlicing", "0x7fffffff"),
			[]wantErr{{tsPath, 8, "2147483647 exceeds the maximum"}}},
		{"beyond int64", ours("timeSlicing", "99999999999999999999"),
			[]wantErr{{tsPath, 8, "expected an integer"}}},
		{"negative", ours("timeSlicing", "-100000"),
			[]wantErr{{tsPath, 8, "must be >= 2, got -100000"}}},
		{"most negative int64", ours("timeSlicing", "-9223372036854775808"),
			[]wantErr{{tsPath, 8, "must be >= 2"}}},
		{"float", ours("timeSlicing", "1e9"),
			[]wantErr{{tsPath, 8, "expected an integer"}}},
		// Paths are the ones the user wrote, in NVIDIA's format too.
		{"NVIDIA format", nvidia("100000"),
			[]wantErr{{"sharing.timeSlicing.resources[0].replicas", 6, "100000 exceeds the maximum"}}},
		{"NVIDIA format at the bound", nvidia(fmt.Sprint(MaxReplicas)), nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, _, err := Parse([]byte(tt.in))
			if tt.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				if got := f.Configs[DefaultConfigName].Sharing.TimeSlicing.Resources[0].Replicas; got != MaxReplicas {
					t.Errorf("replicas = %d, want %d", got, MaxReplicas)
				}
				return
			}
			checkErrors(t, err, tt.want)
		})
	}
}

func TestReplicasBoundInValidate(t *testing.T) {
	// A File built in code meets the same bound as a parsed one.
	f := Default()
	f.Configs[DefaultConfigName].Sharing.MPS = &MPS{Resources: []MPSResource{{
		ReplicatedResource: ReplicatedResource{Name: "nvidia.com/gpu", Replicas: MaxReplicas * 2, Devices: ReplicaDevices{All: true}},
	}}}
	_, err := f.Validate()
	checkErrors(t, err, []wantErr{{"configs.default.sharing.mps.resources[0].replicas", 0, "exceeds the maximum"}})
}

func TestKeyLength(t *testing.T) {
	// 253 bytes: the longest node name, as a DNS subdomain.
	long := strings.Repeat("a", 63) + "." + strings.Repeat("b", 63) + "." + strings.Repeat("c", 63) + "." + strings.Repeat("d", 61)
	if len(long) != maxKeyBytes {
		t.Fatalf("test key is %d bytes", len(long))
	}
	f, _, err := Parse([]byte("version: v1\nnodes:\n  " + long + ": default\nconfigs:\n  default: {}\n"))
	if err != nil || f.Nodes[long] != DefaultConfigName {
		t.Fatalf("a node name of %d bytes: %v", len(long), err)
	}
	_, _, err = Parse([]byte("version: v1\nnodes:\n  " + long + "e: default\nconfigs:\n  default: {}\n"))
	checkErrors(t, err, []wantErr{{"nodes", 3, fmt.Sprintf("of %d bytes exceeds the maximum of %d bytes", maxKeyBytes+1, maxKeyBytes)}})
}

// allocated returns the bytes f allocates on the heap.
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// hostileAllocLimit is what Parse may allocate for a document of n bytes:
// yaml.v3's node tree costs about 125 bytes per input byte, and the
// decoder's bounds (maxNodes, maxValueBytes) cap what aliases add, at a
// cost independent of the input's size.
func hostileAllocLimit(n int) uint64 { return uint64(160*n + 48<<20) }

func TestParseHostileInputsBounded(t *testing.T) {
	// Smaller than MaxBytes to stay quick under -race; the alias cases
	// reach the decoder's bounds at this size already, and the others are
	// linear (BenchmarkParseWorstCase runs them all at MaxBytes).
	const size = 64 << 10
	for _, in := range hostileInputs(size) {
		t.Run(in.name, func(t *testing.T) {
			var err error
			got := allocated(func() { _, _, err = Parse(in.data) })
			if err == nil {
				t.Fatal("accepted")
			}
			errorsOf(t, err)
			if limit := hostileAllocLimit(len(in.data)); got > limit {
				t.Errorf("a %d-byte document allocated %d MiB, more than %d MiB", len(in.data), got>>20, limit>>20)
			}
		})
	}
}

func TestAliasBudgetErrors(t *testing.T) {
	// Each bound of the decoder's budget is reported as the cause.
	tests := []struct{ name, want string }{
		{"billion laughs", fmt.Sprintf("more than %d nodes after expanding aliases", maxNodes)},
		{"long value quoted per alias", fmt.Sprintf("more than %d bytes of values after expanding aliases", maxValueBytes)},
		{"long device list per alias", fmt.Sprintf("more than %d nodes after expanding aliases", maxNodes)},
	}
	inputs := map[string][]byte{}
	for _, in := range hostileInputs(MaxBytes / 4) {
		inputs[in.name] = in.data
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := Parse(inputs[tt.name])
			if err == nil || !strings.Contains(err.Error(), "document too large ("+tt.want+")") {
				t.Errorf("err = %.300v, want document too large (%s)", err, tt.want)
			}
		})
	}
}

func TestLayoutConflictsReportedOnce(t *testing.T) {
	// Three entries for GPU 0: the later two are each reported once,
	// against the first, not against every earlier one.
	_, _, err := Parse([]byte(`version: v1
mig-configs:
  x:
  - {devices: [0], mig-enabled: false}
  - {devices: [0], mig-enabled: false}
  - {devices: [0], mig-enabled: false}
`))
	checkErrors(t, err, []wantErr{
		{"mig-configs.x[1].devices[0]", 5, "GPU 0 is already configured by entry [0]"},
		{"mig-configs.x[2].devices[0]", 6, "GPU 0 is already configured by entry [0]"},
	})
}

// BenchmarkParseWorstCase parses each hostile input at the size limit and
// reports what it allocates per input byte.
func BenchmarkParseWorstCase(b *testing.B) {
	for _, in := range hostileInputs(MaxBytes) {
		b.Run(strings.ReplaceAll(in.name, " ", "_"), func(b *testing.B) {
			// Measured once outside the loop, which ReadMemStats would slow.
			got := allocated(func() {
				if _, _, err := Parse(in.data); err == nil {
					b.Fatal("accepted")
				}
			})
			b.ReportAllocs()
			for b.Loop() {
				_, _, _ = Parse(in.data)
			}
			b.ReportMetric(float64(got)/float64(len(in.data)), "B/input-byte")
		})
	}
}

// Defect: the densest YAML at the size limit (a flat list of one-byte items)
// took 128 MiB to parse, the chart's whole memory limit. It is refused
// before parsing, naming the bound; real configs stay far below it.
func TestParseRefusesTooManyNodes(t *testing.T) {
	flat := "version: v1\nconfigs: {}\nx: [" + strings.Repeat("a,", MaxStructure) + "a]\n"
	_, _, err := Parse([]byte(flat))
	if err == nil || !strings.Contains(err.Error(), "YAML indicators") || !strings.Contains(err.Error(), "100000") {
		t.Fatalf("Parse of %d list items: %v, want the structure bound named", MaxStructure+1, err)
	}
	var b strings.Builder
	b.WriteString("version: v1\nconfigs:\n")
	for i := range 400 {
		fmt.Fprintf(&b, "  c%d:\n    sharing:\n      timeSlicing:\n        resources:\n        - name: nvidia.com/gpu\n          devices: [0, 1, 2, 3, 4, 5, 6, 7]\n          replicas: 4\n", i)
	}
	if _, _, err := Parse([]byte(b.String())); err != nil {
		t.Errorf("400 named configs refused: %v", err)
	}
}
