//go:build e2e

package e2e

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// Who uses the GPU they hold (docs/holders.md), on a real node: each workload container's first process is
// registered with the simulated node under its host PID (read from containerd: a process cannot see its host
// PID from inside its PID namespace), without a cgroup, so the agent, in its DaemonSet pod, finds the pod
// through the host's /proc (--host-proc, the chart's hostPath mount) and the real containerd cgroup, and names
// it through the node's Pods.

// holderPass is the tracker's pass interval (the e2e node's --sample-interval): a holder's series change at
// most this long after what they report does.
const holderPass = harness.SampleInterval

// holderUse is the part of GET /holders the scenarios read.
type holderUse struct {
	GPU         int     `json:"gpu"`
	Device      string  `json:"device"`
	MIGProfile  string  `json:"migProfile"`
	MPS         bool    `json:"mps"`
	MPSLimit    int     `json:"mpsActiveThreadPercent"`
	MPSUsed     float64 `json:"mpsLimitUsedPercent"`
	Namespace   string  `json:"namespace"`
	Pod         string  `json:"pod"`
	Container   string  `json:"container"`
	Sharers     int     `json:"sharers"`
	Attributed  bool    `json:"attributed"`
	Processes   int     `json:"processes"`
	SM          float64 `json:"smPercent"`
	FBBytes     uint64  `json:"fbBytes"`
	IdleSeconds float64 `json:"idleSeconds"`
	Claim       *struct {
		Name string `json:"name"`
	} `json:"claim"`
}

func agentHolders(t *testing.T, agent string) []holderUse {
	t.Helper()
	var snap struct {
		Holders []holderUse `json:"holders"`
	}
	agentGet(t, agent, "/holders", &snap)
	return snap.Holders
}

// seriesValue is the value of the first series of metric on /metrics with all the labels; ok is false if
// there is none.
func seriesValue(t *testing.T, agent, metric string, labels ...string) (float64, bool) {
	t.Helper()
	l := draSeries(t, agent, metric, labels...)
	if l == "" {
		return 0, false
	}
	v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
	if err != nil {
		t.Fatalf("series %q: %v", l, err)
	}
	return v, true
}

// holderLoad is what one workload's process does on its GPU.
type holderLoad struct {
	pod string
	sm  int    // SM %
	fb  uint64 // framebuffer bytes
}

// registerProcess registers pod's container's first process with the simulated node on GPU gpu under its
// host PID, with the load l, and returns the PID.
func registerProcess(t *testing.T, c *harness.Cluster, agent string, gpu int, l holderLoad) int {
	t.Helper()
	return registerProcessOn(t, c, agent, fmt.Sprintf(`"gpu":%d`, gpu), l, "")
}

// registerProcessOn is registerProcess on the device that the JSON fields device name (`"gpu":0`, or
// `"uuid":"MIG-..."` for a MIG device), with the fields extra (`,"mps":true`) added.
func registerProcessOn(t *testing.T, c *harness.Cluster, agent, device string, l holderLoad, extra string) int {
	t.Helper()
	ctx := clusterCtx(t)
	p, err := c.Client.CoreV1().Pods("default").Get(ctx, l.pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	id, err := harness.ContainerID(p)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := c.TaskPID(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	agentPost(t, agent, "/sim/process", fmt.Sprintf(`{%s,"pid":%d,"sm_util":%d,"mem_used_bytes":%d%s}`, device, pid, l.sm, l.fb, extra))
	t.Logf("pod %s: host PID %d registered on %s%s (SM %d%%, %d MiB)", l.pod, pid, device, extra, l.sm, l.fb>>20)
	return pid
}

// holderOf returns pod's entry on /holders, and whether it has one.
func holderOf(t *testing.T, agent, pod string) (holderUse, bool) {
	t.Helper()
	for _, h := range agentHolders(t, agent) {
		if h.Pod == pod {
			return h, true
		}
	}
	return holderUse{}, false
}

// holderSeriesOwn reports whether pod's series on GPU gpu carry its own load: the holder series and, the
// device being shared, dcgm-exporter's per-process DCGM_FI_DEV_GPU_UTIL and DCGM_FI_DEV_FB_USED. extra are
// labels every series must have too (a claim's dra_*). It says what differs, "" when nothing does.
func holderSeriesOwn(t *testing.T, agent string, gpu int, l holderLoad, extra ...string) string {
	t.Helper()
	labels := append([]string{fmt.Sprintf(`gpu="%d"`, gpu), `namespace="default"`, `pod="` + l.pod + `"`, `container="main"`}, extra...)
	for _, w := range []struct {
		metric string
		want   float64
	}{
		{"gpu_agent_holder_sm_util_percent", float64(l.sm)},
		{"gpu_agent_holder_fb_used_bytes", float64(l.fb)},
		{"gpu_agent_holder_processes", 1},
		{"DCGM_FI_DEV_GPU_UTIL", float64(l.sm)},
		{"DCGM_FI_DEV_FB_USED", float64(l.fb >> 20)},
	} {
		v, ok := seriesValue(t, agent, w.metric, labels...)
		if !ok {
			return fmt.Sprintf("%s: no series %v", w.metric, labels)
		}
		if v < w.want-0.5 || v > w.want+0.5 {
			return fmt.Sprintf("%s%v = %g, want %g", w.metric, labels, v, w.want)
		}
	}
	return ""
}

// TestHolderTimeSliced: a GPU time-sliced 4 ways, held by 4 pods on containerd 1.6.
func TestHolderTimeSliced(t *testing.T) { holderTimeSliced(t, "") }

// TestHolderTimeSlicedContainerd2: the same on containerd 2.x, whose cgroup and scope names are its own.
func TestHolderTimeSlicedContainerd2(t *testing.T) { holderTimeSliced(t, inputs.containerd2) }

// holderTimeSliced: 4 pods on replicas of one GPU (packed), each running a process with its own load. Each
// pod's series carry its own numbers; the pod whose process stops using the GPU shows its idle time growing
// while the others stay active; a pod that ends loses its series within one pass of the tracker after it is
// gone from the API.
func holderTimeSliced(t *testing.T, containerd2 string) {
	c, agent := installOverlayOn(t, "sim-overlay", containerd2)
	ctx := clusterCtx(t)
	want := "1.6"
	if containerd2 != "" {
		want = "2."
	}
	v := containerdVersion(t, c)
	if !strings.HasPrefix(v, want) {
		t.Fatalf("containerd %s, want %s", v, want)
	}
	t.Logf("containerd %s", v)
	edited := setConfigMap(t, c, map[string]string{"config.yaml": packedSharedConfig(4)})
	waitOfferedQ(t, c, gpuResource, 4*nodeGPUs, edited)

	loads := []holderLoad{{"holder-a", 10, 1 << 30}, {"holder-b", 20, 2 << 30}, {"holder-c", 30, 3 << 30}, {"holder-d", 35, 512 << 20}}
	for _, l := range loads {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: l.pod, Namespace: "default", Labels: map[string]string{"app": "holders"}},
			Spec:       harness.GPUPodTemplate(nil, gpuResource, 1).Spec,
		}
		if _, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.WaitPodsRunning(ctx, "default", "app=holders", len(loads)); err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}

	// The tracker lists the 4 holders on one GPU before any process runs.
	gpu := -1
	eventually(t, "4 holders of one GPU on /holders", func() bool {
		hs := agentHolders(t, agent)
		if len(hs) != len(loads) {
			return false
		}
		gpu = hs[0].GPU
		for _, h := range hs {
			if h.GPU != gpu || h.Sharers != len(loads) {
				t.Fatalf("/holders: %+v; want the 4 pods on one GPU (packed), each one of 4 sharers", hs)
			}
		}
		return true
	})
	pids := map[string]int{}
	for _, l := range loads {
		pids[l.pod] = registerProcess(t, c, agent, gpu, l)
	}
	registered := time.Now()
	eventually(t, "each pod's series carry its own load", func() bool {
		for _, l := range loads {
			if why := holderSeriesOwn(t, agent, gpu, l); why != "" {
				if time.Since(registered) > 4*holderPass {
					t.Logf("not yet: %s", why)
				}
				return false
			}
		}
		return true
	})
	t.Logf("MEASURED 4 processes registered -> each holder's own series: %s", time.Since(registered).Round(10*time.Millisecond))
	for _, h := range agentHolders(t, agent) {
		if !h.Attributed || h.Processes != 1 {
			t.Errorf("/holders: %+v; want attributed, with its one process", h)
		}
	}

	// holder-a's process stops using the GPU (it keeps its memory): its idle time grows from then, the
	// others' stays below a pass or two.
	idleSince := time.Now()
	agentPost(t, agent, "/sim/process", fmt.Sprintf(`{"gpu":%d,"pid":%d,"sm_util":0}`, gpu, pids["holder-a"]))
	idle := func(pod string) float64 {
		v, ok := seriesValue(t, agent, "gpu_agent_holder_idle_seconds", fmt.Sprintf(`gpu="%d"`, gpu), `pod="`+pod+`"`)
		if !ok {
			t.Fatalf("no gpu_agent_holder_idle_seconds for %s", pod)
		}
		return v
	}
	var first float64
	eventually(t, "holder-a idle for 5 passes", func() bool {
		first = idle("holder-a")
		return first >= 5*holderPass.Seconds()
	})
	for _, l := range loads[1:] {
		// A busy holder's idle time is at most the time since the last pass, which two busy cores can
		// delay by a pass or two.
		if v := idle(l.pod); v >= 3*holderPass.Seconds() {
			t.Errorf("%s, still busy, shows idle %gs while holder-a shows %gs", l.pod, v, first)
		}
	}
	if sm, _ := seriesValue(t, agent, "gpu_agent_holder_sm_util_percent", fmt.Sprintf(`gpu="%d"`, gpu), `pod="holder-a"`); sm != 0 {
		t.Errorf("holder-a, idle, shows SM %g%%", sm)
	}
	if first > time.Since(idleSince).Seconds()+holderPass.Seconds() {
		t.Errorf("holder-a idle %gs, %s after its process stopped", first, time.Since(idleSince))
	}
	var later float64
	eventually(t, "holder-a's idle time growing", func() bool {
		later = idle("holder-a")
		return later > first
	})
	t.Logf("holder-a idle %gs, then %gs; holder-b %gs", first, later, idle("holder-b"))

	// holder-d ends: once its pod is gone from the API (the kubelet has stopped it, and pod-resources no longer
	// lists it), its series go within one pass.
	if err := c.Client.CoreV1().Pods("default").Delete(ctx, "holder-d", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "holder-d gone from the API", func() bool {
		_, err := c.Client.CoreV1().Pods("default").Get(ctx, "holder-d", metav1.GetOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
		return apierrors.IsNotFound(err)
	})
	gone := time.Now()
	eventually(t, "holder-d's series gone", func() bool {
		return draSeries(t, agent, "gpu_agent_holder_idle_seconds", `pod="holder-d"`) == "" &&
			draSeries(t, agent, "gpu_agent_holder_sm_util_percent", `pod="holder-d"`) == "" &&
			draSeries(t, agent, "DCGM_FI_DEV_GPU_UTIL", `pod="holder-d"`) == ""
	})
	took := time.Since(gone)
	t.Logf("MEASURED pod gone from the API -> its holder series gone from /metrics: %s", took.Round(10*time.Millisecond))
	if took > holderPass+5*time.Second {
		t.Errorf("holder-d's series outlived its pod by %s, more than one pass (%s)", took, holderPass)
	}
	for _, l := range loads[1:3] {
		if why := holderSeriesOwn(t, agent, gpu, l); why != "" {
			t.Errorf("after holder-d ended: %s", why)
		}
	}
	for _, h := range agentHolders(t, agent) {
		if h.Sharers != 3 {
			t.Errorf("/holders after holder-d ended: %+v; want 3 sharers", h)
		}
	}
}

// containerdVersion is the version of the node's containerd.
func containerdVersion(t *testing.T, c *harness.Cluster) string {
	t.Helper()
	v, err := c.ContainerdVersion(clusterCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// draHolderLabels are the labels of a claim's holder series on /metrics: dcgm-exporter's dra_* labels.
func draHolderLabels(c *harness.Cluster, claim string) []string {
	return []string{`dra_claim_name="` + claim + `"`, `dra_claim_namespace="default"`, `dra_driver_name="` + draDriver + `"`,
		`dra_pool_name="` + c.NodeName() + `"`, `dra_device_name="gpu-0"`}
}

// sharedClaimsOnGPU0 creates a claim per load for a share of GPU 0 (the class's default share, or memory where
// asked) and its pod, named as the claim, and waits until both hold it on /holders.
func sharedClaimsOnGPU0(t *testing.T, c *harness.Cluster, agent string, loads []holderLoad) {
	t.Helper()
	for _, l := range loads {
		cl := wholeGPUClaim(l.pod)
		cl.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: "device.attributes['gpu.nvidia.com'].index == 0",
		}}}
		took := claimAndRun(t, c, cl)
		t.Logf("MEASURED DRA claim (a share of GPU 0) created -> container running: %s", took.Round(10*time.Millisecond))
	}
	eventually(t, "the claims' holders on /holders", func() bool {
		for _, l := range loads {
			h, ok := holderOf(t, agent, l.pod)
			if !ok || h.Claim == nil || h.Claim.Name != l.pod || h.GPU != 0 || h.Sharers != len(loads) {
				return false
			}
		}
		return true
	})
}

// checkClaimSeries registers each load's process on GPU 0 (fields extra added) and waits until each claim's
// series, with its dra_* labels, carry its own numbers.
func checkClaimSeries(t *testing.T, c *harness.Cluster, agent string, loads []holderLoad, extra string) {
	t.Helper()
	for _, l := range loads {
		registerProcessOn(t, c, agent, `"gpu":0`, l, extra)
	}
	registered := time.Now()
	eventually(t, "each claim's series carry its own load", func() bool {
		for _, l := range loads {
			if why := holderSeriesOwn(t, agent, 0, l, draHolderLabels(c, l.pod)...); why != "" {
				if time.Since(registered) > 4*holderPass {
					t.Logf("not yet: %s", why)
				}
				return false
			}
		}
		return true
	})
	t.Logf("MEASURED %d processes registered -> each claim's own series: %s", len(loads), time.Since(registered).Round(10*time.Millisecond))
}

// TestHolderDRASharedClaim: two DRA claims share GPU 0 (time-slicing ×4 through the DRA driver's shares); each
// claim's pod runs a process with its own load. Each claim's series, labelled with its dra_* labels, carry its
// own numbers; the claim whose pod ends loses its series, the other keeps them.
func TestHolderDRASharedClaim(t *testing.T) {
	c, agent := installDRA(t)
	holderDRASharedClaim(t, c, agent)
}

// TestHolderDRASharedClaimContainerd2: the same on containerd 2.x, where the claims' devices come through CDI.
func TestHolderDRASharedClaimContainerd2(t *testing.T) {
	c, agent := installOverlayOn(t, "sim-dra-overlay", inputs.containerd2)
	holderDRASharedClaim(t, c, agent)
}

func holderDRASharedClaim(t *testing.T, c *harness.Cluster, agent string) {
	t.Logf("containerd %s", containerdVersion(t, c))
	setConfigMap(t, c, map[string]string{"config.yaml": timeSliced4})
	eventually(t, "gpu-0 shared 4 ways in the ResourceSlice", func() bool {
		q, ok := nodeSlice(t, c)["gpu-0"].Capacity["shares"]
		return ok && q.Value.Value() == 4
	})
	loads := []holderLoad{{"share-a", 15, 1 << 30}, {"share-b", 40, 3 << 30}}
	sharedClaimsOnGPU0(t, c, agent, loads)
	checkClaimSeries(t, c, agent, loads, "")

	if err := c.Client.CoreV1().Pods("default").Delete(clusterCtx(t), "share-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	eventually(t, "share-b's series gone, share-a's kept", func() bool {
		return draSeries(t, agent, "gpu_agent_holder_sm_util_percent", `dra_claim_name="share-b"`) == "" &&
			draSeries(t, agent, "gpu_agent_holder_fb_used_bytes", `dra_claim_name="share-b"`) == "" &&
			draSeries(t, agent, "gpu_agent_holder_sm_util_percent", `dra_claim_name="share-a"`) != ""
	})
	t.Logf("MEASURED claim's pod deleted -> its holder series gone: %s", time.Since(deleted).Round(10*time.Millisecond))
}

// TestHolderMPS: GPU 0 shared by MPS between 2 clients (DRA claims, gpu-agent's stand-in control daemon) on
// containerd 1.6: each client's process is an MPS one in NVML's lists, and each claim's series carry its own
// numbers. containerd 1.6 has no CDI, so the containers do not get the claims' MPS settings: what is checked
// is the agent's side.
func TestHolderMPS(t *testing.T) {
	c, agent := installOverlayOn(t, "sim-dra-overlay", "", func(_ *harness.Cluster, l *harness.NodeLayer) {
		l.ExtraArgs = append(l.ExtraArgs, "--mps-binary="+mpsStandIn)
	})
	holderMPS(t, c, agent)
}

// TestHolderMPSContainerd2: the same on containerd 2.x, where the containers get them through CDI.
func TestHolderMPSContainerd2(t *testing.T) {
	c, agent := installDRAWithFakeMPS(t)
	holderMPS(t, c, agent)
}

func holderMPS(t *testing.T, c *harness.Cluster, agent string) {
	t.Logf("containerd %s", containerdVersion(t, c))
	shareGPU0ByMPS(t, c)
	loads := []holderLoad{{"mps-a", 25, 2 << 30}, {"mps-b", 60, 4 << 30}}
	sharedClaimsOnGPU0(t, c, agent, loads)
	checkClaimSeries(t, c, agent, loads, `,"mps":true`)
	// Each claim takes the class's default share, 1 of the GPU's 2: its client's
	// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is that part of 100 (agent/prepare.go, mpsClient).
	const limit = 100 / 2
	for _, l := range loads {
		used := float64(l.sm) * 100 / limit // 25% SM of a 50% limit: 50; 60%: 120
		if h, _ := holderOf(t, agent, l.pod); !h.MPS || h.Processes != 1 || h.MPSLimit != limit || math.Abs(h.MPSUsed-used) > 1 {
			t.Errorf("/holders: %+v; want its one process, an MPS client, limit %d%%, %g%% of it used", h, limit, used)
		} else {
			t.Logf("%s: MPS limit %d%%, %g%% of it used (SM %g%%)", l.pod, h.MPSLimit, h.MPSUsed, h.SM)
		}
		labels := append([]string{`gpu="0"`, `pod="` + l.pod + `"`}, draHolderLabels(c, l.pod)...)
		for _, w := range []struct {
			metric string
			want   float64
		}{
			{"gpu_agent_holder_mps_active_thread_limit_percent", limit},
			{"gpu_agent_holder_mps_limit_used_percent", used},
		} {
			if v, ok := seriesValue(t, agent, w.metric, labels...); !ok || math.Abs(v-w.want) > 1 {
				t.Errorf("%s%v = %g (found: %v), want %g", w.metric, labels, v, ok, w.want)
			}
		}
	}
}

// TestHolderMIG: GPU 0 laid out as two 3g.20gb MIG devices on an A100, each held by a pod running a process.
// NVML has no per-process utilization on MIG and an A100 MIG device no figure of its own, so each holder's
// series are its own memory and process count, and no SM or idle series: unknown is not idle.
func TestHolderMIG(t *testing.T) { holderMIG(t, "") }

// TestHolderMIGContainerd2: the same on containerd 2.x.
func TestHolderMIGContainerd2(t *testing.T) { holderMIG(t, inputs.containerd2) }

func holderMIG(t *testing.T, containerd2 string) {
	c, agent := installOverlayOn(t, "sim-mig-overlay", containerd2)
	t.Logf("containerd %s", containerdVersion(t, c))
	const res = "nvidia.com/mig-3g.20gb"
	edited := setConfigMap(t, c, map[string]string{"config.yaml": migLayoutConfig(`{"3g.20gb": 2}`)})
	waitOfferedQ(t, c, res, 2*nodeGPUs, edited)
	ctx := clusterCtx(t)
	loads := []holderLoad{{"mig-a", 0, 5 << 30}, {"mig-b", 0, 7 << 30}}
	for _, l := range loads {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: l.pod, Namespace: "default", Labels: map[string]string{"app": "mig-holders"}},
			Spec:       harness.GPUPodTemplate(nil, res, 1).Spec,
		}
		if _, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.WaitPodsRunning(ctx, "default", "app=mig-holders", len(loads)); err != nil {
		dumpPods(t, c, "default")
		t.Fatal(err)
	}
	devices := map[string]holderUse{}
	eventually(t, "the MIG holders on /holders", func() bool {
		for _, l := range loads {
			h, ok := holderOf(t, agent, l.pod)
			if !ok {
				return false
			}
			devices[l.pod] = h
		}
		return true
	})
	if devices["mig-a"].Device == devices["mig-b"].Device {
		t.Fatalf("both pods hold %s", devices["mig-a"].Device)
	}
	for _, l := range loads {
		h := devices[l.pod]
		if h.MIGProfile != "3g.20gb" || h.Sharers != 1 || !strings.HasPrefix(h.Device, "MIG-") {
			t.Fatalf("/holders: %+v; want a 3g.20gb MIG device of its own", h)
		}
		registerProcessOn(t, c, agent, `"uuid":"`+h.Device+`"`, l, "")
	}
	registered := time.Now()
	eventually(t, "each MIG holder's memory and process", func() bool {
		for _, l := range loads {
			labels := []string{fmt.Sprintf(`gpu="%d"`, devices[l.pod].GPU), `pod="` + l.pod + `"`, `GPU_I_PROFILE="3g.20gb"`}
			fb, ok1 := seriesValue(t, agent, "gpu_agent_holder_fb_used_bytes", labels...)
			n, ok2 := seriesValue(t, agent, "gpu_agent_holder_processes", labels...)
			if !ok1 || !ok2 || fb != float64(l.fb) || n != 1 {
				return false
			}
		}
		return true
	})
	t.Logf("MEASURED 2 MIG processes registered -> each holder's own memory: %s", time.Since(registered).Round(10*time.Millisecond))
	for _, l := range loads {
		for _, m := range []string{"gpu_agent_holder_sm_util_percent", "gpu_agent_holder_idle_seconds"} {
			if s := draSeries(t, agent, m, `pod="`+l.pod+`"`); s != "" {
				t.Errorf("%s on an A100 MIG device with a process: %s; want none (unknown)", l.pod, s)
			}
		}
	}
}
