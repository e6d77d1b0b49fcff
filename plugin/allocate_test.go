package plugin

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/ledger"
)

const (
	resGPU    = "example.com/gpu"
	resShared = "example.com/gpu.shared"
)

func gpuDevice(i int, numa int) catalog.Device {
	id := "GPU-" + string(rune('a'+i))
	return catalog.Device{
		ID: id, Healthy: true, NUMANode: numa, GPU: i,
		Spec: catalog.AllocateSpec{VisibleID: id, DeviceNodes: []string{"/dev/nvidia" + string(rune('0'+i))}},
	}
}

// testCatalog has four whole GPUs (NUMA 0, 0, 1, unknown) and three
// time-sliced replicas, two of them on one GPU.
func testCatalog() *catalog.Catalog {
	common := catalog.AllocateSpec{
		DeviceNodes: []string{"/dev/nvidiactl", "/dev/nvidia-uvm"},
		Mounts:      []catalog.Mount{{HostPath: "/usr/lib/libcuda.so", ContainerPath: "/usr/lib/libcuda.so", ReadOnly: true}},
	}
	replica := func(gpu int, n string) catalog.Device {
		d := gpuDevice(gpu, 0)
		d.ID = d.ID + "::" + n
		d.Replica = true
		d.Spec.Env = map[string]string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
		return d
	}
	return &catalog.Catalog{Resources: map[string]*catalog.Resource{
		resGPU: {
			Name:    resGPU,
			Devices: []catalog.Device{gpuDevice(0, 0), gpuDevice(1, 0), gpuDevice(2, 1), gpuDevice(3, -1)},
			Common:  common,
		},
		resShared: {
			Name:    resShared,
			Devices: []catalog.Device{replica(0, "0"), replica(0, "1"), replica(1, "0")},
			Common:  common,
		},
	}}
}

// withHealth returns a copy of cat in which device id of resource res has the given health.
func withHealth(cat *catalog.Catalog, res, id string, healthy bool, reason string) *catalog.Catalog {
	out := &catalog.Catalog{Resources: map[string]*catalog.Resource{}}
	for name, r := range cat.Resources {
		c := *r
		if name == res {
			c.Devices = append([]catalog.Device(nil), r.Devices...)
			for i := range c.Devices {
				if c.Devices[i].ID == id {
					c.Devices[i].Healthy, c.Devices[i].Reason = healthy, reason
				}
			}
		}
		out.Resources[name] = &c
	}
	return out
}

func allocReq(containers ...[]string) *pluginapi.AllocateRequest {
	req := &pluginapi.AllocateRequest{}
	for _, ids := range containers {
		req.ContainerRequests = append(req.ContainerRequests, &pluginapi.ContainerAllocateRequest{DevicesIds: ids})
	}
	return req
}

type wantContainer struct {
	env     map[string]string
	devices []string // host paths, in order
	mounts  []string // container paths, in order
}

func checkContainer(t *testing.T, got *pluginapi.ContainerAllocateResponse, want wantContainer) {
	t.Helper()
	if !reflect.DeepEqual(got.GetEnvs(), want.env) {
		t.Errorf("env = %v, want %v", got.GetEnvs(), want.env)
	}
	var devs []string
	for _, d := range got.GetDevices() {
		if d.GetContainerPath() != d.GetHostPath() || d.GetPermissions() != "rw" {
			t.Errorf("device spec %v: want ContainerPath=HostPath and rw", d)
		}
		devs = append(devs, d.GetHostPath())
	}
	if !reflect.DeepEqual(devs, want.devices) {
		t.Errorf("devices = %v, want %v", devs, want.devices)
	}
	var mounts []string
	for _, m := range got.GetMounts() {
		mounts = append(mounts, m.GetContainerPath())
	}
	if !reflect.DeepEqual(mounts, want.mounts) {
		t.Errorf("mounts = %v, want %v", mounts, want.mounts)
	}
}

func TestAllocate(t *testing.T) {
	cat := testCatalog()
	ctl := []string{"/dev/nvidiactl", "/dev/nvidia-uvm"}
	lib := []string{"/usr/lib/libcuda.so"}
	tests := []struct {
		name string
		res  string
		req  *pluginapi.AllocateRequest
		want []wantContainer
	}{
		{
			name: "one GPU",
			res:  resGPU, req: allocReq([]string{"GPU-c"}),
			want: []wantContainer{{
				env:     map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-c"},
				devices: append(ctl, "/dev/nvidia2"), mounts: lib,
			}},
		},
		{
			name: "request order kept, two containers",
			res:  resGPU, req: allocReq([]string{"GPU-d", "GPU-a"}, []string{"GPU-b"}),
			want: []wantContainer{
				{env: map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-d,GPU-a"}, devices: append(ctl, "/dev/nvidia3", "/dev/nvidia0"), mounts: lib},
				{env: map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-b"}, devices: append(ctl, "/dev/nvidia1"), mounts: lib},
			},
		},
		{
			name: "replicas of one GPU appear once",
			res:  resShared, req: allocReq([]string{"GPU-b::0", "GPU-a::1", "GPU-a::0"}),
			want: []wantContainer{{
				env: map[string]string{
					"NVIDIA_VISIBLE_DEVICES":            "GPU-b,GPU-a",
					"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
				},
				devices: append(ctl, "/dev/nvidia1", "/dev/nvidia0"), mounts: lib,
			}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := allocate(cat.Resources[tt.res], tt.req)
			if err != nil {
				t.Fatal(err)
			}
			if len(resp.GetContainerResponses()) != len(tt.want) {
				t.Fatalf("%d container responses, want %d", len(resp.GetContainerResponses()), len(tt.want))
			}
			for i, w := range tt.want {
				checkContainer(t, resp.GetContainerResponses()[i], w)
			}
		})
	}
}

func TestAllocateErrors(t *testing.T) {
	cat := withHealth(testCatalog(), resGPU, "GPU-b", false, "XID 79 (fallen off the bus)")
	conflict := testCatalog()
	shared := conflict.Resources[resShared]
	shared.Devices = append([]catalog.Device(nil), shared.Devices...)
	shared.Devices[2].Spec.Env = map[string]string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
	limited := testCatalog()
	limitedShared := *limited.Resources[resShared]
	limitedShared.MaxPerContainer = 1
	// Whole GPUs and replicas under one name (time-slicing some GPUs without rename).
	limitedMixed := *limited.Resources[resGPU]
	limitedMixed.MaxPerContainer = 1
	limitedMixed.Devices = append(append([]catalog.Device(nil), limitedMixed.Devices...), limitedShared.Devices...)
	slices.SortFunc(limitedMixed.Devices, func(a, b catalog.Device) int { return strings.Compare(a.ID, b.ID) })
	mountClash := testCatalog()
	gpus := mountClash.Resources[resGPU]
	gpus.Devices = append([]catalog.Device(nil), gpus.Devices...)
	gpus.Devices[0].Spec.Mounts = []catalog.Mount{{HostPath: "/other/libcuda.so", ContainerPath: "/usr/lib/libcuda.so"}}

	tests := []struct {
		name     string
		res      *catalog.Resource
		req      *pluginapi.AllocateRequest
		code     codes.Code
		contains []string
	}{
		{"unknown ID", cat.Resources[resGPU], allocReq([]string{"GPU-a", "GPU-zz"}), codes.NotFound,
			[]string{`"GPU-zz"`, resGPU, "unknown"}},
		{"unhealthy ID", cat.Resources[resGPU], allocReq([]string{"GPU-b"}), codes.FailedPrecondition,
			[]string{`"GPU-b"`, resGPU, "unhealthy", "XID 79"}},
		// The first container alone is valid: nothing may be returned for it.
		{"second container bad", cat.Resources[resGPU], allocReq([]string{"GPU-a"}, []string{"GPU-b"}), codes.FailedPrecondition,
			[]string{"container request 1", `"GPU-b"`}},
		{"empty request", cat.Resources[resGPU], allocReq([]string{}), codes.InvalidArgument, []string{resGPU}},
		{"env conflict", conflict.Resources[resShared], allocReq([]string{"GPU-a::0", "GPU-b::0"}), codes.InvalidArgument,
			[]string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "GPU-b::0", resShared}},
		{"whole devices are not limited, a replica among them is", &limitedMixed, allocReq([]string{"GPU-b"}, []string{"GPU-a", "GPU-a::0"}), codes.InvalidArgument,
			[]string{"container request 1", "too large: maximum request size for shared resources is 1"}},
		{"more than one shared replica", &limitedShared, allocReq([]string{"GPU-a::1"}, []string{"GPU-a::0", "GPU-b::0"}), codes.InvalidArgument,
			[]string{"container request 1", "request for '" + resShared + ": 2' too large: maximum request size for shared resources is 1"}},
		{"mount conflict", mountClash.Resources[resGPU], allocReq([]string{"GPU-a"}), codes.InvalidArgument,
			[]string{"/usr/lib/libcuda.so", resGPU}},
		{"duplicate replica", testCatalog().Resources[resShared], allocReq([]string{"GPU-a::0"}, []string{"GPU-b::0", "GPU-b::0"}),
			codes.InvalidArgument, []string{"container request 1: ", `device "GPU-b::0" requested twice`, resShared}},
		// Issue 23, defect 9: refused within one container, accepted across two.
		{"one ID in two containers", testCatalog().Resources[resGPU], allocReq([]string{"GPU-a"}, []string{"GPU-c", "GPU-a"}),
			codes.InvalidArgument, []string{`device "GPU-a" requested by container requests 0 and 1`, resGPU}},
		{"one replica in two containers", testCatalog().Resources[resShared], allocReq([]string{"GPU-a::0"}, []string{"GPU-a::0"}),
			codes.InvalidArgument, []string{`device "GPU-a::0" requested by container requests 0 and 1`, resShared}},
		{"more IDs than devices", testCatalog().Resources[resShared], allocReq([]string{"GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-q::0"}),
			codes.InvalidArgument, []string{"4 device IDs requested, more than the 3 devices it has", resShared}},
		{"no container requests", cat.Resources[resGPU], allocReq(), codes.InvalidArgument,
			[]string{"no container requests", resGPU}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := allocate(tt.res, tt.req)
			if err == nil {
				t.Fatalf("no error; response %v", resp)
			}
			if resp != nil {
				t.Errorf("a response came with the error: %v", resp)
			}
			if got := status.Code(err); got != tt.code {
				t.Errorf("code = %v, want %v (%v)", got, tt.code, err)
			}
			for _, s := range tt.contains {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not contain %q", err, s)
				}
			}
			// One status: its text says "rpc error" once, not once per wrap.
			if n := strings.Count(err.Error(), "rpc error"); n != 1 {
				t.Errorf("error %q says \"rpc error\" %d times", err, n)
			}
		})
	}
}

// preferFunc adapts a function to catalog.Preferrer.
type preferFunc func(available, must []string, size int) ([]string, error)

func (f preferFunc) Preferred(available, must []string, size int) ([]string, error) {
	return f(available, must, size)
}

func prefReq(available, must []string, size int) *pluginapi.ContainerPreferredAllocationRequest {
	return &pluginapi.ContainerPreferredAllocationRequest{AvailableDeviceIDs: available, MustIncludeDeviceIDs: must, AllocationSize: int32(size)}
}

func TestPreferredDefault(t *testing.T) {
	res := testCatalog().Resources[resGPU]
	all := []string{"GPU-d", "GPU-c", "GPU-b", "GPU-a"} // kubelet order need not be ours
	tests := []struct {
		name string
		req  *pluginapi.ContainerPreferredAllocationRequest
		want []string
	}{
		{"catalog order", prefReq(all, nil, 2), []string{"GPU-a", "GPU-b"}},
		{"must-include first", prefReq(all, []string{"GPU-d"}, 2), []string{"GPU-d", "GPU-a"}},
		{"skips unavailable", prefReq([]string{"GPU-c", "GPU-d", "GPU-b"}, nil, 2), []string{"GPU-b", "GPU-c"}},
		{"all", prefReq(all, []string{"GPU-c", "GPU-a"}, 4), []string{"GPU-c", "GPU-a", "GPU-b", "GPU-d"}},
		{"ID unknown to the catalog fills last", prefReq([]string{"GPU-new", "GPU-a"}, nil, 2), []string{"GPU-a", "GPU-new"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := preferred(res, tt.req)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestPreferredInvalidRequest(t *testing.T) {
	res := testCatalog().Resources[resGPU]
	called := false
	res.Preferred = preferFunc(func([]string, []string, int) ([]string, error) {
		called = true
		return nil, nil
	})
	tests := []struct {
		name string
		req  *pluginapi.ContainerPreferredAllocationRequest
	}{
		{"size zero", prefReq([]string{"GPU-a"}, nil, 0)},
		{"size below must-include", prefReq([]string{"GPU-a", "GPU-b"}, []string{"GPU-a", "GPU-b"}, 1)},
		{"must-include not available", prefReq([]string{"GPU-a", "GPU-b"}, []string{"GPU-c"}, 2)},
		{"not enough available", prefReq([]string{"GPU-a", "GPU-b"}, nil, 3)},
		{"duplicates do not count twice", prefReq([]string{"GPU-a", "GPU-a"}, nil, 2)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			called = false
			_, err := preferred(res, tt.req)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), resGPU) {
				t.Errorf("err = %v, want InvalidArgument naming %s", err, resGPU)
			}
			if called {
				t.Error("Preferrer was asked about an invalid request")
			}
		})
	}
}

func TestPreferredPreferrer(t *testing.T) {
	avail := []string{"GPU-a", "GPU-b", "GPU-c", "GPU-d"}
	tests := []struct {
		name    string
		answer  []string
		err     error
		wantErr string // "" = answer accepted
	}{
		{"valid answer used", []string{"GPU-c", "GPU-d"}, nil, ""},
		{"too few", []string{"GPU-c"}, nil, "1 devices, want 2"},
		{"too many", []string{"GPU-c", "GPU-d", "GPU-a"}, nil, "3 devices, want 2"},
		{"duplicate", []string{"GPU-c", "GPU-c"}, nil, "twice"},
		{"not available", []string{"GPU-c", "GPU-x"}, nil, `"GPU-x" is not available`},
		{"must-include missing", []string{"GPU-c", "GPU-d"}, nil, `must-include device "GPU-a" missing`},
		{"preferrer error", nil, errors.New("topology unknown"), "topology unknown"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := testCatalog().Resources[resGPU]
			var gotArgs []any
			res.Preferred = preferFunc(func(a, m []string, size int) ([]string, error) {
				gotArgs = []any{a, m, size}
				return tt.answer, tt.err
			})
			var must []string
			if strings.HasPrefix(tt.name, "must-include") {
				must = []string{"GPU-a"}
			}
			got, err := preferred(res, prefReq(avail, must, 2))
			if !reflect.DeepEqual(gotArgs, []any{avail, must, 2}) {
				t.Errorf("Preferrer called with %v", gotArgs)
			}
			if tt.wantErr == "" {
				if err != nil || !reflect.DeepEqual(got, tt.answer) {
					t.Fatalf("got %v, %v; want %v", got, err, tt.answer)
				}
				return
			}
			if err == nil {
				t.Fatalf("answer %v accepted", got)
			}
			if !strings.Contains(err.Error(), tt.wantErr) || !strings.Contains(err.Error(), resGPU) {
				t.Errorf("err = %v, want it to name %s and say %q", err, resGPU, tt.wantErr)
			}
		})
	}
}

func TestDefaultSocketName(t *testing.T) {
	tests := map[string]string{
		"nvidia.com/gpu":              "gpu-agent-nvidia.com-gpu.sock",
		"nvidia.com/mig-1g.10gb":      "gpu-agent-nvidia.com-mig-1g.10gb.sock",
		"example.com/odd name:x":      "gpu-agent-example.com-odd_name_x.sock",
		"nvidia.com/gpu.shared_extra": "gpu-agent-nvidia.com-gpu.shared_extra.sock",
	}
	for in, want := range tests {
		if got := DefaultSocketName(in); got != want {
			t.Errorf("DefaultSocketName(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestMaxPerContainerOnlyLimitsReplicas(t *testing.T) {
	cat := testCatalog()
	mixed := *cat.Resources[resGPU]
	mixed.MaxPerContainer = 1
	if _, err := allocate(&mixed, allocReq([]string{"GPU-a", "GPU-b"})); err != nil {
		t.Errorf("two whole GPUs refused by a replica limit: %v", err)
	}
}

// TestDeviceListStrategies checks each of NVIDIA's device list strategies,
// alone and combined, on a request for two replicas of one GPU and one of a
// second: what the container is told, and that with CDI alone the response
// carries no device nodes and no NVIDIA_VISIBLE_DEVICES.
func TestDeviceListStrategies(t *testing.T) {
	type want struct {
		env        string // NVIDIA_VISIBLE_DEVICES ("" absent)
		mounts     []string
		nodes      int
		annotation string // value of the one CDI annotation ("" none)
		annPrefix  string
		cdiDevices []string
	}
	cdiNames := "nvidia.com/gpu=GPU-a,nvidia.com/gpu=GPU-b"
	tests := []struct {
		name     string
		delivery catalog.Delivery
		want     want
	}{
		{"default envvar", catalog.Delivery{}, want{env: "GPU-a,GPU-b", nodes: 4}},
		{"envvar", catalog.Delivery{Strategies: []string{"envvar"}}, want{env: "GPU-a,GPU-b", nodes: 4}},
		{"volume-mounts", catalog.Delivery{Strategies: []string{"volume-mounts"}},
			want{env: "/var/run/nvidia-container-devices", nodes: 4, mounts: []string{"/var/run/nvidia-container-devices/GPU-a", "/var/run/nvidia-container-devices/GPU-b"}}},
		{"cdi-annotations", catalog.Delivery{Strategies: []string{"cdi-annotations"}},
			want{annotation: cdiNames, annPrefix: "cdi.k8s.io/gpu-agent_"}},
		{"cdi-annotations, own prefix", catalog.Delivery{Strategies: []string{"cdi-annotations"}, CDIAnnotationPrefix: "nvidia.cdi.k8s.io/"},
			want{annotation: cdiNames, annPrefix: "nvidia.cdi.k8s.io/gpu-agent_"}},
		{"cdi-cri", catalog.Delivery{Strategies: []string{"cdi-cri"}}, want{cdiDevices: []string{"nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"}}},
		{"envvar and cdi-cri", catalog.Delivery{Strategies: []string{"envvar", "cdi-cri"}},
			want{env: "GPU-a,GPU-b", nodes: 4, cdiDevices: []string{"nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"}}},
		{"all four", catalog.Delivery{Strategies: []string{"envvar", "volume-mounts", "cdi-annotations", "cdi-cri"}},
			want{env: "/var/run/nvidia-container-devices", nodes: 4, mounts: []string{"/var/run/nvidia-container-devices/GPU-a", "/var/run/nvidia-container-devices/GPU-b"},
				annotation: cdiNames, annPrefix: "cdi.k8s.io/gpu-agent_", cdiDevices: []string{"nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := testCatalog().Resources[resShared]
			res.Delivery = tt.delivery
			resp, err := allocate(res, allocReq([]string{"GPU-a::0", "GPU-a::1", "GPU-b::0"}))
			if err != nil {
				t.Fatal(err)
			}
			c := resp.ContainerResponses[0]
			if got, ok := c.Envs[visibleDevicesEnv]; got != tt.want.env || ok != (tt.want.env != "") {
				t.Errorf("NVIDIA_VISIBLE_DEVICES %q (set %v), want %q", got, ok, tt.want.env)
			}
			if c.Envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" {
				t.Errorf("env %v: the replicas' own environment is lost", c.Envs)
			}
			var mounts []string
			for _, m := range c.Mounts {
				if m.HostPath == "/dev/null" {
					mounts = append(mounts, m.ContainerPath)
					if !m.ReadOnly {
						t.Errorf("device list mount %s is writable", m.ContainerPath)
					}
				}
			}
			if !slices.Equal(mounts, tt.want.mounts) {
				t.Errorf("device list mounts %v, want %v", mounts, tt.want.mounts)
			}
			if len(c.Devices) != tt.want.nodes {
				t.Errorf("%d device nodes, want %d", len(c.Devices), tt.want.nodes)
			}
			if tt.want.annotation == "" && len(c.Annotations) > 0 {
				t.Errorf("annotations %v, want none", c.Annotations)
			}
			if tt.want.annotation != "" {
				if len(c.Annotations) != 1 {
					t.Fatalf("annotations %v, want one", c.Annotations)
				}
				for k, v := range c.Annotations {
					if !strings.HasPrefix(k, tt.want.annPrefix) || v != tt.want.annotation {
						t.Errorf("annotation %s=%s, want %s<id>=%s", k, v, tt.want.annPrefix, tt.want.annotation)
					}
				}
			}
			var cdi []string
			for _, d := range c.CdiDevices {
				cdi = append(cdi, d.Name)
			}
			if !slices.Equal(cdi, tt.want.cdiDevices) {
				t.Errorf("CDI devices %v, want %v", cdi, tt.want.cdiDevices)
			}
		})
	}
}

// Two containers of one pod get distinct annotation keys: the runtime
// merges the annotations of all of a container's responses.
func TestCDIAnnotationKeysDistinct(t *testing.T) {
	res := testCatalog().Resources[resGPU]
	res.Delivery = catalog.Delivery{Strategies: []string{"cdi-annotations"}}
	resp, err := allocate(res, allocReq([]string{"GPU-a"}, []string{"GPU-b"}))
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	for _, c := range resp.ContainerResponses {
		for k := range c.Annotations {
			keys[k] = true
		}
	}
	if len(keys) != 2 {
		t.Errorf("annotation keys %v, want two distinct", keys)
	}
}

// Admit sees each device behind a request once (replicas name their GPU),
// only for a request the catalog allows, and its refusal is the answer,
// with its message: Unavailable for an allocation the ledger could not
// record, FailedPrecondition for any other.
func TestAdmit(t *testing.T) {
	dir := shortDir(t)
	var got [][]string
	refuse := error(nil)
	startManagerWith(t, testCatalog(), Options{Dir: dir, Admit: func(res string, devs []Handout) error {
		seen := []string{res}
		for _, d := range devs {
			if !d.Replica {
				t.Errorf("Admit saw %s whole, from %s, which has only replicas", d.UUID, res)
			}
			seen = append(seen, d.UUID)
		}
		got = append(got, seen)
		return refuse
	}})
	shared := dialPlugin(t, filepath.Join(dir, DefaultSocketName(resShared)))
	ctx := context.Background()
	if _, err := shared.Allocate(ctx, allocReq([]string{"GPU-a::0"}, []string{"GPU-a::1", "GPU-b::0"})); err != nil {
		t.Fatal(err)
	}
	if want := [][]string{{resShared, "GPU-a", "GPU-b"}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("Admit saw %v, want %v", got, want)
	}
	if _, err := shared.Allocate(ctx, allocReq([]string{"GPU-zz::0"})); status.Code(err) != codes.NotFound || len(got) != 1 {
		t.Fatalf("unknown device: %v, Admit called %d times; want NotFound before Admit", err, len(got))
	}
	for _, tc := range []struct {
		refuse error
		code   codes.Code
	}{
		{errors.New("device GPU-a is being repartitioned"), codes.FailedPrecondition},
		{&ledger.RefusedError{Device: "GPU-a", Reason: ledger.ErrPrepared, Detail: "prepared for ResourceClaim ml/c through DRA"}, codes.FailedPrecondition},
		{fmt.Errorf("not recorded: %w", ledger.ErrLogUnavailable), codes.Unavailable},
	} {
		refuse = tc.refuse
		resp, err := shared.Allocate(ctx, allocReq([]string{"GPU-a::0"}))
		if status.Code(err) != tc.code || status.Convert(err).Message() != tc.refuse.Error() || resp != nil {
			t.Errorf("refused by %v: answer %v, %v; want %v with its message", tc.refuse, resp, err, tc.code)
		}
	}
}

// TestAllocateLargeRequests covers requests past smallSet, where the
// duplicate checks switch from comparing to a map: order is kept, replicas
// of one GPU name it once, and a duplicate is found wherever it sits.
func TestAllocateLargeRequests(t *testing.T) {
	const gpus = 2*smallSet + 3
	res := &catalog.Resource{Name: resShared}
	var whole, replicas []string
	for i := range gpus {
		g := fmt.Sprintf("GPU-%03d", i)
		whole = append(whole, g)
		for r := range 2 {
			id := fmt.Sprintf("%s::%d", g, r)
			replicas = append(replicas, id)
			res.Devices = append(res.Devices, catalog.Device{ID: id, Healthy: true, Replica: true, GPU: i,
				Spec: catalog.AllocateSpec{VisibleID: g}})
		}
	}
	slices.SortFunc(res.Devices, func(a, b catalog.Device) int { return strings.Compare(a.ID, b.ID) })
	reversed := slices.Clone(replicas)
	slices.Reverse(reversed)
	wantReversed := slices.Clone(whole)
	slices.Reverse(wantReversed)
	tests := []struct {
		name    string
		ids     []string
		visible []string // "": an error
		errHas  string
	}{
		{name: "every replica", ids: replicas, visible: whole},
		{name: "every replica, reversed", ids: reversed, visible: wantReversed},
		{name: "a duplicate past smallSet", ids: append(slices.Clone(replicas[:smallSet+5]), replicas[3]),
			errHas: "device \"GPU-001::1\" requested twice"},
		{name: "a duplicate right at smallSet", ids: append(slices.Clone(replicas[:smallSet]), replicas[smallSet-1]),
			errHas: fmt.Sprintf("device %q requested twice", replicas[smallSet-1])},
		{name: "a duplicate within smallSet", ids: []string{replicas[0], replicas[1], replicas[0]},
			errHas: "device \"GPU-000::0\" requested twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := allocate(res, allocReq(tt.ids))
			if tt.errHas != "" {
				if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.errHas) {
					t.Fatalf("error %v, want InvalidArgument with %q", err, tt.errHas)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := resp.GetContainerResponses()[0].GetEnvs()[visibleDevicesEnv]
			if want := strings.Join(tt.visible, ","); got != want {
				t.Errorf("NVIDIA_VISIBLE_DEVICES = %s, want %s", got, want)
			}
		})
	}
}

// TestRequestedIDs: OnAllocate gets every container's IDs, in order.
func TestRequestedIDs(t *testing.T) {
	for _, tt := range []struct {
		req  *pluginapi.AllocateRequest
		want []string
	}{
		{allocReq([]string{"GPU-a"}), []string{"GPU-a"}},
		{allocReq([]string{"GPU-b", "GPU-a"}, []string{"GPU-d"}), []string{"GPU-b", "GPU-a", "GPU-d"}},
		{allocReq(), nil},
	} {
		if got := requestedIDs(tt.req); !slices.Equal(got, tt.want) {
			t.Errorf("requestedIDs(%v) = %v, want %v", tt.req, got, tt.want)
		}
	}
}
