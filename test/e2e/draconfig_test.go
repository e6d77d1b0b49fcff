//go:build e2e

package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// NVIDIA's opaque device config on the real control plane: on a node whose config shares nothing, a claim
// through a DeviceClass whose config asks for MPS, and a claim whose own config asks for MPS with other limits
// (it beats the class's), each run as a pod. Each container gets, from its claim's CDI spec, the pipe
// directory of a daemon started for the claim on its GPU and the limits of the config that won.
func TestClusterDRAMPSConfigContainerd2(t *testing.T) {
	c, _ := installDRAWithFakeMPS(t)
	ctx := clusterCtx(t)
	setConfigMap(t, c, map[string]string{"config.yaml": "version: v1\nconfigs:\n  default: {}\n"})
	mpsConfig := func(percent int, pinned string) runtime.RawExtension {
		return runtime.RawExtension{Raw: fmt.Appendf(nil, `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig",`+
			`"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":%d,"defaultPinnedDeviceMemoryLimit":%q}}}`, percent, pinned)}
	}
	class := &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: "gpu-mps.e2e.example.com"},
		Spec: resourceapi.DeviceClassSpec{
			Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}},
			Config: []resourceapi.DeviceClassConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{
				Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: draDriver, Parameters: mpsConfig(40, "2Gi")},
			}}},
		},
	}
	if _, err := c.Client.ResourceV1().DeviceClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Client.ResourceV1().DeviceClasses().Delete(clusterCtx(t), class.Name, metav1.DeleteOptions{})
	})

	tests := []struct {
		name          string
		index         int
		claimConfig   bool
		percent, pins string
	}{
		{"mps-by-class", 1, false, "40", "0=2048M"},
		{"mps-by-claim", 2, true, "25", "0=4096M"},
	}
	for _, tt := range tests {
		cl := wholeGPUClaim(tt.name)
		req := cl.Spec.Devices.Requests[0].Exactly
		req.DeviceClassName = class.Name
		req.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf("device.attributes['gpu.nvidia.com'].index == %d", tt.index),
		}}}
		if tt.claimConfig {
			cl.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{Requests: []string{"gpu"}, DeviceConfiguration: resourceapi.DeviceConfiguration{
				Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: draDriver, Parameters: mpsConfig(25, "4Gi")},
			}}}
		}
		took := claimAndRun(t, c, cl)
		t.Logf("MEASURED DRA claim (MPS by opaque config, daemon started for it) created -> container running: %s", took.Round(10*time.Millisecond))
		pods, err := c.WaitPodsRunning(clusterCtx(t), "default", "app="+tt.name, 1)
		if err != nil {
			t.Fatal(err)
		}
		env, err := c.PodContainerEnv(clusterCtx(t), &pods[0])
		if err != nil {
			t.Fatal(err)
		}
		uuid := attr(nodeSlice(t, c)[fmt.Sprintf("gpu-%d", tt.index)], "uuid")
		if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != tt.percent || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] != tt.pins ||
			!strings.Contains(env["CUDA_MPS_PIPE_DIRECTORY"], uuid) || uuid == "" {
			t.Fatalf("claim %s: container env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q CUDA_MPS_PIPE_DIRECTORY=%q; want %s, %s and the pipe directory of GPU %d (%s)",
				tt.name, env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["CUDA_MPS_PIPE_DIRECTORY"], tt.percent, tt.pins, tt.index, uuid)
		}
		t.Logf("claim %s: %s%% of the threads, %s, pipe %s", tt.name, env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], env["CUDA_MPS_PIPE_DIRECTORY"])
	}
}
